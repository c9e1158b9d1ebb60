"""The canary schedule as a pure decision (start, step, hold, rollback, promote), without Kafka."""

from __future__ import annotations

from typing import Any

import pytest

from inference_workers.routing import RoutingSettings, resolve
from streams.context import BuildContext
from streams.errors import TopologyError
from streams.lifecycle.canary import CONFIDENCE_P50, decide, last_share_change_ms
from streams.lifecycle.canary_job import CanaryJob
from streams.lifecycle.state import ModelEvent, ModelPolicy, ModelRegistryState, Stage, version_from_fields
from streams.settings import StackSettings
from streams.statelog import LogRecord
from reference import SCHEMAS
from streams.topology import Topology

SCHEDULE = {"initial_share": 0.1, "step": 0.2, "interval_s": 10, "max_share": 0.5, "min_events": 50,
            "max_confidence_p50_drop": 0.05}
HEALTHY = {"1": [0.95] * 100, "2": [0.94] * 100}  # 1 % lower
WORSE = {"1": [0.95] * 100, "2": [0.80] * 100}  # 16 % lower


def commit(state: ModelRegistryState, events: list[ModelEvent]) -> ModelEvent:
    for e in events:
        rec = e.record()
        state.apply_record(LogRecord.from_bytes(rec.key_bytes(), rec.value_bytes()))
    return events[-1]


def with_challenger(admission: dict[str, Any] | None = None, **canary: Any) -> ModelRegistryState:
    state = ModelRegistryState()
    for v in ("1", "2"):
        commit(state, state.register(version_from_fields(
            {"name": "anomaly", "version": v, "sha256": f"{int(v):064x}", "artifact": f"anomaly/{v}/model.onnx",
             "framework": "onnx", "owner": "ml", "license": "Apache-2.0", "dataset_version": "sim"}), "alice", ""))
    commit(state, state.promote("anomaly", "1", Stage.PRODUCTION, "alice", "first"))
    policy = ModelPolicy.model_validate({
        "admission": admission or {"min_shadow_events": 100, "metric": CONFIDENCE_P50, "margin": 0.02},
        "canary": {**SCHEDULE, **canary}})
    commit(state, state.set_policy("anomaly", policy, "alice"))
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "bob", "retrained"))
    return state


def at_share(state: ModelRegistryState, share: float) -> int:
    """Set the canary share as the job would; returns the event's time (ms)."""
    return commit(state, state.set_canary("anomaly", share, "pm.canary", "test")).at_ms


def test_no_challenger_is_idle_and_a_new_challenger_starts_at_the_initial_share() -> None:
    state = with_challenger()
    m = state.models["anomaly"]
    d = decide(m, {}, now_ms=0)
    assert d.action == "start" and d.share == 0.1 and "then +20% every 10s" in d.reason
    assert last_share_change_ms(m) is None
    commit(state, state.canary_rollback("anomaly", "x", "", {}))
    assert decide(state.models["anomaly"], HEALTHY, now_ms=0).action == "idle"


def test_manual_start_keeps_the_challenger_in_shadow() -> None:
    d = decide(with_challenger(start="manual").models["anomaly"], HEALTHY, now_ms=0)
    assert d.action == "hold" and "tangram models canary anomaly 0.1" in d.reason


def test_steps_once_per_interval_while_healthy_and_never_past_the_max() -> None:
    state = with_challenger()
    t = at_share(state, 0.1)
    m = state.models["anomaly"]
    assert decide(m, {"1": [0.9] * 100, "2": [0.9] * 10}, now_ms=t + 60_000).action == "hold"  # waiting for events
    early = decide(m, HEALTHY, now_ms=t + 9_000)
    assert early.action == "hold" and "for 9.0s of 10s" in early.reason
    step = decide(m, HEALTHY, now_ms=t + 10_000)
    assert step.action == "step" and step.share == pytest.approx(0.3) and step.verdict.healthy
    t = at_share(state, 0.4)
    assert decide(state.models["anomaly"], HEALTHY, now_ms=t + 10_000).share == pytest.approx(0.5)


def test_a_worse_canary_rolls_back_at_any_share_with_the_verdict() -> None:
    state = with_challenger()
    t = at_share(state, 0.1)
    d = decide(state.models["anomaly"], WORSE, now_ms=t + 1)
    assert d.action == "rollback" and d.verdict.healthy is False and d.verdict.drop == pytest.approx(0.158, abs=1e-3)
    assert "automatic at 10%" in d.reason and "beyond 5%" in d.reason


def test_at_the_max_share_the_challenger_is_promoted_once_the_admission_rule_passes() -> None:
    state = with_challenger()
    t = at_share(state, 0.5)
    m = state.models["anomaly"]
    assert decide(m, HEALTHY, now_ms=t + 5_000).action == "hold"  # one more healthy interval at the max first
    short = decide(m, HEALTHY, now_ms=t + 10_000, canary_events=40)
    assert short.action == "hold" and "needs 100 shadow-scored events, has 40" in short.reason
    d = decide(m, HEALTHY, now_ms=t + 10_000, canary_events=400)
    assert d.action == "promote" and d.admission["passed"]
    assert d.evidence.events == 400 and d.evidence.challenger == pytest.approx(0.94)
    # what the controller does with it: record the evidence, then promote; the registry's own check agrees
    commit(state, state.record_shadow("anomaly", "2", d.evidence.events, CONFIDENCE_P50, d.evidence.challenger,
                                      d.evidence.production, "pm.canary"))
    promoted = commit(state, state.promote("anomaly", "2", Stage.PRODUCTION, "pm.canary", d.reason))
    assert promoted.data["admission"]["passed"] and promoted.data["replaces"] == "1"
    routing = state.routing("anomaly")
    assert routing.production.version == "2" and routing.challenger is None and routing.canary_share == 0
    assert routing.standby.version == "1"  # what a rollback serves: a worker may keep it loaded
    commit(state, state.rollback("anomaly", "oncall", "drill"))
    assert state.routing("anomaly").production.version == "1" and state.routing("anomaly").standby is None


def test_a_canary_worse_than_the_admission_margin_stays_at_the_max() -> None:
    state = with_challenger(admission={"min_shadow_events": 10, "metric": CONFIDENCE_P50, "margin": 0.005})
    t = at_share(state, 0.5)
    d = decide(state.models["anomaly"], HEALTHY, now_ms=t + 10_000, canary_events=400)  # 0.01 worse > 0.005
    assert d.action == "hold" and "waiting for the admission rule" in d.reason and "beyond the margin" in d.reason


def test_manual_promotion_and_a_metric_the_canary_does_not_measure_wait_for_an_operator() -> None:
    state = with_challenger(promote="manual")
    t = at_share(state, 0.5)
    d = decide(state.models["anomaly"], HEALTHY, now_ms=t + 10_000, canary_events=400)
    assert d.action == "hold" and "tangram models promote anomaly 2 --to production" in d.reason

    state = with_challenger(admission={"min_shadow_events": 100, "metric": "accuracy", "margin": 0.01})
    t = at_share(state, 0.5)
    d = decide(state.models["anomaly"], HEALTHY, now_ms=t + 10_000, canary_events=400)
    assert d.action == "hold" and d.evidence is None and "needs 100 shadow-scored events, has 0" in d.reason
    commit(state, state.record_shadow("anomaly", "2", 500, "accuracy", 0.99, 0.985, "labeller"))
    d = decide(state.models["anomaly"], HEALTHY, now_ms=t + 10_000, canary_events=400)
    assert d.action == "promote" and d.evidence is None  # the labelled evidence stands, untouched


def test_the_interval_restarts_when_a_version_becomes_challenger_again() -> None:
    state = with_challenger()
    at_share(state, 0.3)
    commit(state, state.canary_rollback("anomaly", "pm.canary", "worse", {}))
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "bob", "fixed"))
    m = state.models["anomaly"]
    assert last_share_change_ms(m) is None and decide(m, HEALTHY, now_ms=0).action == "start"


def test_the_registry_and_the_worker_agree_on_which_entities_are_in_the_canary() -> None:
    state = with_challenger()
    at_share(state, 0.3)
    routing = state.routing("anomaly")
    plan = resolve(RoutingSettings(production="1", challenger="2", canary_share=0.3), "anomaly")
    keys = [f"dev-{i:04d}" for i in range(2000)]
    assert [routing.serving(k).version == "2" for k in keys] == plan.canary_mask(keys).tolist()


def _context(**canary: Any) -> BuildContext:
    topology = Topology.model_validate({
        "app": "pm", "schemas": str(SCHEMAS),
        "topics": {"pm.predictions.anomaly": {"schema": "pm.predictions.anomaly-value"},
                   "pm.features.device_window": {"schema": "pm.features.device_window-value"}},
        "processors": {"canary": {"kind": "streams.lifecycle.canary_job:CanaryJob",
                                  "inputs": ["pm.predictions.anomaly"], "params": {"model": "anomaly"}, **canary}}})
    return BuildContext(topology, "canary", StackSettings())


@pytest.mark.parametrize("spec, message", [
    ({"replicas": 2}, "run exactly one replica"),
    ({"outputs": ["pm.features.device_window"]}, "writes only to the model registry"),
    ({"inputs": ["pm.features.device_window"]}, "is not a predictions topic"),
    ({"params": {"model": "anomaly", "tick": 1}}, "tick"),
])
def test_the_canary_job_refuses_a_topology_it_cannot_run_faithfully(spec: dict[str, Any], message: str) -> None:
    with pytest.raises((TopologyError, ValueError), match=message):
        CanaryJob.build(_context(**spec))
