"""Model registry state, admission rules, canary health and artifact checks, without Kafka."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streams.errors import ArtifactIntegrityError, ModelRegistryError
from streams.lifecycle.artifacts import card_fields, sha256_file, verify_artifact
from streams.lifecycle.canary import judge
from streams.lifecycle.state import (
    CanarySchedule,
    ModelEvent,
    ModelPolicy,
    ModelRegistryState,
    Stage,
    version_from_fields,
)
from streams.statelog import LogRecord, entity_share


def fields(version: str, **extra: Any) -> dict[str, Any]:
    base = {"name": "anomaly", "version": version, "sha256": f"{int(version):064x}", "artifact": f"anomaly/{version}/model.onnx",
            "framework": "onnx", "owner": "ml-platform", "license": "Apache-2.0", "dataset_version": "20240501",
            "training_metrics": {"accuracy": 0.99}}
    return {**base, **extra}


def commit(state: ModelRegistryState, events: list[ModelEvent]) -> list[ModelEvent]:
    """Apply events through their wire form, as a watcher does after the broker acknowledged them."""
    for e in events:
        rec = e.record()
        state.apply_record(LogRecord.from_bytes(rec.key_bytes(), rec.value_bytes()))
    return events


def registered(*versions: str) -> ModelRegistryState:
    state = ModelRegistryState()
    for v in versions:
        commit(state, state.register(version_from_fields(fields(v)), "alice", "trained"))
    return state


def replayed(state: ModelRegistryState) -> ModelRegistryState:
    fresh = ModelRegistryState()
    for m in state.models.values():
        for e in m.events:
            fresh.apply(e)
    return fresh


def test_registration_without_dataset_version_is_refused_with_a_clear_message() -> None:
    for missing in ({"dataset_version": None}, {"dataset_version": "  "}, {}):
        f = fields("1", **missing) if missing else {k: v for k, v in fields("1").items() if k != "dataset_version"}
        with pytest.raises(ModelRegistryError, match="dataset_version is mandatory"):
            version_from_fields(f)


def test_registration_names_invalid_fields() -> None:
    with pytest.raises(ModelRegistryError, match="sha256"):
        version_from_fields(fields("1", sha256="not-hex"))


def test_a_version_is_immutable_and_reregistering_the_same_digest_is_a_no_op() -> None:
    state = registered("1")
    assert state.register(version_from_fields(fields("1")), "alice") == []
    with pytest.raises(ModelRegistryError, match="immutable"):
        state.register(version_from_fields(fields("1", sha256="f" * 64)), "alice")


def test_stages_are_recorded_with_who_when_why() -> None:
    state = registered("1", "2")
    commit(state, state.promote("anomaly", "1", Stage.PRODUCTION, "alice", "first model"))
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "bob", "retrained on May data"))
    m = state.models["anomaly"]
    assert m.production == "1" and m.challenger == "2"
    last = m.events[-1]
    assert (last.actor, last.reason, last.data["from"], last.data["to"]) == ("bob", "retrained on May data", "Staging", "Challenger")
    assert last.at_ms > 0
    routing = m.routing()
    assert routing.production.version == "1" and routing.challenger.version == "2" and routing.shadow


def test_illegal_moves_are_refused() -> None:
    state = registered("1", "2", "3")
    commit(state, state.promote("anomaly", "1", Stage.PRODUCTION, "a", ""))
    with pytest.raises(ModelRegistryError, match="must be Challenger"):
        state.promote("anomaly", "2", Stage.PRODUCTION, "a", "")
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "a", ""))
    with pytest.raises(ModelRegistryError, match="already has a challenger"):
        state.promote("anomaly", "3", Stage.CHALLENGER, "a", "")
    with pytest.raises(ModelRegistryError, match="leaves the model with nothing"):
        state.promote("anomaly", "1", Stage.ARCHIVED, "a", "")
    with pytest.raises(ModelRegistryError, match="not registered"):
        state.promote("fraud", "1", Stage.CHALLENGER, "a", "")


def test_admission_needs_shadow_events_and_a_metric_within_the_margin() -> None:
    state = registered("1", "2")
    commit(state, state.promote("anomaly", "1", Stage.PRODUCTION, "a", ""))
    policy = ModelPolicy.model_validate({"admission": {"min_shadow_events": 500, "metric": "accuracy", "margin": 0.01}})
    commit(state, state.set_policy("anomaly", policy, "a"))
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "a", ""))
    with pytest.raises(ModelRegistryError, match="needs 500 shadow-scored events, has 0"):
        state.promote("anomaly", "2", Stage.PRODUCTION, "a", "")
    commit(state, state.record_shadow("anomaly", "2", 300, "accuracy", 0.97, 0.99, "shadow"))
    commit(state, state.record_shadow("anomaly", "2", 300, "accuracy", 0.97, 0.99, "shadow"))
    with pytest.raises(ModelRegistryError, match="beyond the margin"):
        state.promote("anomaly", "2", Stage.PRODUCTION, "a", "")
    commit(state, state.record_shadow("anomaly", "2", 100, "accuracy", 0.985, 0.99, "shadow"))
    [event] = commit(state, state.promote("anomaly", "2", Stage.PRODUCTION, "a", "passed shadow"))
    assert event.data["admission"]["passed"] and event.data["admission"]["events"] == 700
    m = state.models["anomaly"]
    assert m.production == "2" and m.stages["1"] is Stage.ARCHIVED and m.production_history == ["1", "2"]


def test_forcing_past_the_admission_rule_is_recorded() -> None:
    state = registered("1", "2")
    commit(state, state.promote("anomaly", "1", Stage.PRODUCTION, "a", ""))
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "a", ""))
    [event] = commit(state, state.promote("anomaly", "2", Stage.PRODUCTION, "a", "hotfix", force=True))
    assert event.data["forced"] and not event.data["admission"]["passed"]


def test_rollback_restores_the_previous_production_and_can_go_further_back() -> None:
    state = registered("1", "2", "3")
    for v in ("1", "2", "3"):
        if state.models["anomaly"].production:
            commit(state, state.promote("anomaly", v, Stage.CHALLENGER, "a", ""))
        commit(state, state.promote("anomaly", v, Stage.PRODUCTION, "a", "", force=True))
    commit(state, state.rollback("anomaly", "oncall", "p99 up"))
    assert state.routing("anomaly").production.version == "2"
    commit(state, state.rollback("anomaly", "oncall", "still bad"))
    assert state.routing("anomaly").production.version == "1"
    with pytest.raises(ModelRegistryError, match="no earlier Production"):
        state.rollback("anomaly", "oncall", "")
    assert replayed(state).routing("anomaly") == state.routing("anomaly")


def test_canary_share_routes_a_stable_slice_of_entities() -> None:
    state = registered("1", "2")
    commit(state, state.promote("anomaly", "1", Stage.PRODUCTION, "a", ""))
    with pytest.raises(ModelRegistryError, match="no Challenger"):
        state.set_canary("anomaly", 0.1, "a", "")
    commit(state, state.promote("anomaly", "2", Stage.CHALLENGER, "a", ""))
    commit(state, state.set_canary("anomaly", 0.2, "a", "start"))
    routing = state.routing("anomaly")
    assert routing.canary_share == 0.2 and not routing.shadow
    served = [routing.serving(f"dev-{i:04d}").version for i in range(5000)]
    assert 0.17 < served.count("2") / len(served) < 0.23
    assert served == [routing.serving(f"dev-{i:04d}").version for i in range(5000)]  # stable per entity
    commit(state, state.canary_rollback("anomaly", "ctl", "p50 down", {"drop": 0.1}))
    routing = state.routing("anomaly")
    assert routing.challenger is None and routing.canary_share == 0 and state.models["anomaly"].stages["2"] is Stage.STAGING


def test_a_retried_event_is_applied_once() -> None:
    state = registered("1")
    m = state.models["anomaly"]
    assert state.apply(m.events[0]) is False and len(m.events) == 1


def test_canary_health_follows_the_seeds_rule() -> None:
    schedule = CanarySchedule(min_events=50, max_confidence_p50_drop=0.05)
    assert judge([0.9] * 10, [0.9] * 10, schedule).healthy is None
    ok = judge([0.90] * 100, [0.87] * 100, schedule)  # 3.3 % lower
    bad = judge([0.90] * 100, [0.84] * 100, schedule)  # 6.7 % lower
    assert ok.healthy is True and bad.healthy is False and bad.drop == pytest.approx(0.0667, abs=1e-3)


def test_entity_share_is_uniform_and_salted() -> None:
    shares = [entity_share(f"d{i}") for i in range(10000)]
    assert 0.45 < sum(s < 0.5 for s in shares) / len(shares) < 0.55
    assert entity_share("d1", "a") != entity_share("d1", "b")


def test_tampered_artifact_is_refused(tmp_path: Path) -> None:
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(b"model bytes")
    digest = sha256_file(artifact)
    assert verify_artifact(artifact, digest) == artifact
    artifact.write_bytes(b"model bytez")
    with pytest.raises(ArtifactIntegrityError, match="will not be loaded"):
        verify_artifact(artifact, digest, model="anomaly", version="1")
    with pytest.raises(ArtifactIntegrityError, match="missing"):
        verify_artifact(tmp_path / "gone.onnx", digest)


def test_model_card_fields_and_a_card_whose_artifact_changed(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"onnx")
    card = {"name": "m", "version": "1", "framework": "onnx", "sha256": sha256_file(tmp_path / "m" / "1" / "model.onnx"),
            "classes": ["a", "b"], "features": ["x"], "metrics": {"accuracy": 0.9, "per_class": {}}}
    (tmp_path / "m" / "model_card.json").write_text(json.dumps(card))
    f = card_fields(tmp_path / "m" / "model_card.json", tmp_path)
    assert f["artifact"] == "m/1/model.onnx" and f["training_metrics"] == {"accuracy": 0.9} and "dataset_version" not in f
    with pytest.raises(ModelRegistryError, match="dataset_version is mandatory"):
        version_from_fields({**f, "owner": "o", "license": "l"})
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"onnx!")
    with pytest.raises(ArtifactIntegrityError, match="changed after training"):
        card_fields(tmp_path / "m" / "model_card.json", tmp_path)
