"""The demo's lifecycle drill on the real stack: a model version promoted and rolled back while the reference
app runs, each change timed from the registry event to the first prediction by the version it names
(issue #21: the rollback measured from the registry event to the first prediction by the previous version).

The drill registers the built version's artifact again as the next version in the session's model registry
and leaves the built version Production after its rollback; it runs last among the registry's users.
"""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console

from isolation import isolated_topology
from pm_app.simulator import Device, Fleet, FleetSettings, FleetSimulator
from streams.demo import run_pipeline
from streams.lifecycle.registry import ModelRegistry
from streams.topology import load_topology

pytestmark = pytest.mark.integration


def test_the_drill_promotes_and_rolls_back_live_and_times_each_change(stack, tmp_path):
    path, _ = isolated_topology(tmp_path)
    topology = load_topology(path)
    rng = np.random.default_rng(3)
    devices = [Device.random(f"drill-{i}", rng) for i in range(6)]
    simulator = FleetSimulator(topology, FleetSettings(), entities=len(devices), seed=3,
                               fleet=Fleet(devices, hz=10.0, seed=3))
    summary = run_pipeline(stack, path, simulator, 48.0, console=Console(force_terminal=False), drill=True)
    print("\n" + "\n".join(summary.drill))
    assert summary.events_sent > 0
    assert len(summary.drill) == 3, summary.drill
    promoted, production, rollback = summary.drill
    assert "first prediction by" in production and "first prediction by" in rollback, summary.drill
    took = float(rollback.split(" s after the registry event")[0].rsplit(" ", 1)[1])
    rto = topology.processors["inference"].evolution.rollback_rto_s
    assert took <= rto, f"rollback took {took} s, the topology declares rollback_rto_s {rto}"
    registry = ModelRegistry(stack.kafka)
    try:
        model = registry.refresh().models["anomaly"]
        assert model.production is not None and model.production != max(model.versions, key=int)
    finally:
        registry.close()
