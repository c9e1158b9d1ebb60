"""Version routing without a broker: the canary share, its stability, version strings, the routing file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from pydantic import ValidationError

from inference_workers.routing import (
    ModelTarget,
    RoutingFile,
    RoutingSettings,
    VersionRouting,
    key_bucket,
)

KEYS = [f"dev-{i:05d}" for i in range(10_000)]


@pytest.mark.parametrize("share", [0.01, 0.05, 0.1, 0.25, 0.5, 0.9])
def test_canary_share_is_within_two_points_over_10k_keys(share: float) -> None:
    plan = VersionRouting(RoutingSettings(production="1", challenger="2", canary_share=share), "anomaly").plan
    measured = plan.canary_mask(KEYS).mean()
    assert abs(measured - share) <= 0.02, f"declared {share:.2%}, measured {measured:.2%}"


def test_a_key_always_goes_to_the_same_version_and_raising_the_share_only_adds_keys() -> None:
    routing = VersionRouting(RoutingSettings(production="1", challenger="2", canary_share=0.1), "anomaly")
    first = routing.plan.canary_mask(KEYS)
    assert np.array_equal(first, routing.plan.canary_mask(KEYS))  # stable
    assert key_bucket("dev-00001") == key_bucket(b"dev-00001")
    routing.switch(routing.candidate(RoutingSettings(production="1", challenger="2", canary_share=0.3)))
    wider = routing.plan.canary_mask(KEYS)
    assert not (first & ~wider).any()  # nobody moved back to production
    assert wider.sum() > first.sum()


def test_shadow_and_single_version_plans_route_no_canary() -> None:
    shadow = VersionRouting(RoutingSettings(challenger="2", mode="shadow", canary_share=0.5), "anomaly").plan
    assert shadow.shadow and not shadow.canary_mask(KEYS).any()
    single = VersionRouting(RoutingSettings(), "anomaly").plan
    assert single.targets == (ModelTarget("anomaly", "1"),) and not single.canary_mask(KEYS).any()


def test_version_strings() -> None:
    assert ModelTarget.parse("2", "anomaly") == ModelTarget("anomaly", "2")
    assert ModelTarget.parse("anomaly_b:3", "anomaly") == ModelTarget("anomaly_b", "3")
    assert str(ModelTarget("anomaly", "2")) == "anomaly:2"
    with pytest.raises(ValueError, match="expected"):
        ModelTarget.parse("latest", "anomaly")
    with pytest.raises(ValidationError, match="is the production version"):
        RoutingSettings(production="2", challenger="2")
    with pytest.raises(ValidationError):
        RoutingSettings(canary_share=1.5)
    with pytest.raises(ValidationError):
        RoutingSettings(weights=[1])  # extra fields are refused


def test_routing_file_is_read_on_change_and_a_bad_file_keeps_the_current_routing(tmp_path) -> None:
    path = tmp_path / "routing.json"
    watcher = RoutingFile(path)
    assert watcher.poll() is None  # no file yet
    path.write_text(json.dumps({"production": "1", "challenger": "2", "canary_share": 0.2}))
    assert watcher.poll() == RoutingSettings(production="1", challenger="2", canary_share=0.2)
    assert watcher.poll() is None  # unchanged
    path.write_text(json.dumps({"production": "2"}))
    os.utime(path, ns=(1, 1))  # a different modification time, whatever the clock's resolution
    assert watcher.poll() == RoutingSettings(production="2")
    path.write_text("{not json")
    assert watcher.poll() is None
