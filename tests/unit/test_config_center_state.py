"""Config center state: validation, versions, diffs, scopes, conflicts, snapshot/restore, without Kafka."""

from __future__ import annotations

from typing import Any

import pytest

from streams.config_center.schemas import ConfigSchemas, Declaration
from streams.config_center.state import ConfigOp, ConfigState, Scope
from streams.errors import ConfigCenterError, ConfigValidationError
from streams.statelog import LogRecord

RULES = {"rules": [{"name": "bearing", "when": "score > 0.9", "action": "maintenance", "cooldown_s": 60}]}


def op(ns: str, key: str, value: Any = None, **kw: Any) -> ConfigOp:
    return ConfigOp(namespace=ns, key=key, value=value, **kw)


def commit(state: ConfigState, ops: list[ConfigOp], author: str = "alice", reason: str = "test") -> int:
    """Prepare, then apply through the wire form (as every subscriber does); returns the version."""
    change = state.prepare(ops, author, reason)
    rec = change.record()
    applied = state.apply_record(LogRecord.from_bytes(rec.key_bytes(), rec.value_bytes()))
    assert applied is not None
    return applied.version


def test_each_namespace_validates_its_values() -> None:
    state = ConfigState()
    assert commit(state, [op("feature-switch", "enable_band_energy", True),
                          op("feature-switch", "degradation.level", "L2"),
                          op("monitor-threshold", "latency_p95_ms", 200),
                          op("model-config", "anomaly", {"timeout_ms": 500, "retries": 2}),
                          op("business-rule", "pm", RULES)]) == 1
    assert state.get("model-config", "anomaly") == {"endpoint": None, "timeout_ms": 500, "retries": 2, "max_batch_size": None}
    assert state.namespace("feature-switch") == {"enable_band_energy": True, "degradation.level": "L2"}


@pytest.mark.parametrize(("ns", "key", "value", "message"), [
    ("feature-switch", "enable_x", "yes", "valid boolean"),
    ("feature-switch", "degradation.level", "L7", "L0"),
    ("monitor-threshold", "latency_p95_ms", float("nan"), "finite"),
    ("monitor-threshold", "latency_p95_ms", "200", "valid number"),
    ("model-config", "anomaly", {"timeout_ms": -1}, "greater than 0"),
    ("model-config", "anomaly", {"timeout_ms": 5, "colour": "red"}, "Extra inputs"),
    ("business-rule", "pm", {"rules": []}, "at least 1"),
    ("business-rule", "pm", {"rules": [RULES["rules"][0], RULES["rules"][0]]}, "unique"),
    ("no-such-namespace", "k", 1, "unknown namespace"),
])
def test_an_invalid_value_is_refused_and_named(ns: str, key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigValidationError, match=message):
        ConfigState().prepare([op(ns, key, value)], "alice", "")


def test_one_invalid_value_refuses_the_whole_change() -> None:
    state = ConfigState()
    commit(state, [op("feature-switch", "a", True)])
    with pytest.raises(ConfigValidationError, match="nothing was published.*feature-switch/b"):
        state.prepare([op("feature-switch", "a", False), op("feature-switch", "b", "nope")], "alice", "")
    assert state.version == 1 and state.get("feature-switch", "a") is True


def test_an_invalid_record_written_past_the_writer_is_not_applied_by_subscribers() -> None:
    writer, subscriber = ConfigState(), ConfigState()
    change = writer.prepare([op("feature-switch", "a", True)], "mallory", "")
    forged = change.model_copy(update={"ops": [op("feature-switch", "a", "not a bool")]})
    assert subscriber.apply(forged) is None
    assert subscriber.version == 0 and "invalid" in subscriber.rejected[0][1]


def test_versions_diffs_and_history() -> None:
    state = ConfigState()
    commit(state, [op("monitor-threshold", "latency_p95_ms", 200)], reason="initial")
    commit(state, [op("monitor-threshold", "latency_p95_ms", 250), op("monitor-threshold", "error_rate_alert", 0.01)],
           author="bob", reason="noisy alerts")
    commit(state, state.delete_ops("monitor-threshold", "error_rate_alert"), reason="oops")
    assert state.version == 3
    texts = [[d.text() for d in a.diff] for a in state.history]
    assert texts == [["+ monitor-threshold/latency_p95_ms = 200.0"],
                     ["+ monitor-threshold/error_rate_alert = 0.01", "~ monitor-threshold/latency_p95_ms: 200.0 → 250.0"],
                     ["- monitor-threshold/error_rate_alert (was 0.01)"]]
    assert state.history[1].change.author == "bob" and state.history[1].change.reason == "noisy alerts"
    assert [a.version for a in state.changes_of("monitor-threshold", "error_rate_alert")] == [2, 3]
    assert state.at(2).get("monitor-threshold", "error_rate_alert") == 0.01


def test_a_change_that_changes_nothing_is_refused() -> None:
    state = ConfigState()
    commit(state, [op("feature-switch", "a", True)])
    with pytest.raises(ConfigCenterError, match="would not change"):
        state.prepare([op("feature-switch", "a", True)], "alice", "")


def test_concurrent_changes_on_the_same_version_conflict_deterministically() -> None:
    a, b = ConfigState(), ConfigState()
    first = a.prepare([op("feature-switch", "x", True)], "alice", "")
    second = a.prepare([op("feature-switch", "x", False)], "bob", "")  # made against the same version 0
    for state in (a, b):
        state.apply(first)
        state.apply(second)
        assert state.version == 1 and state.get("feature-switch", "x") is True
        assert "conflict" in state.rejected[0][1]
    assert a.apply(first) is None  # a retried record is applied once


def test_scoped_values_by_prefix_and_share() -> None:
    state = ConfigState()
    commit(state, [op("monitor-threshold", "vibration_alert", 7.0),
                   op("monitor-threshold", "vibration_alert", 5.0, scope=Scope(prefix="dev-00")),
                   op("monitor-threshold", "vibration_alert", 6.0, scope=Scope(share=0.2))])
    assert state.get("monitor-threshold", "vibration_alert") == 7.0
    assert state.get("monitor-threshold", "vibration_alert", entity="dev-0012") == 5.0
    others = [state.get("monitor-threshold", "vibration_alert", entity=f"m-{i}") for i in range(5000)]
    assert 0.17 < others.count(6.0) / len(others) < 0.23 and set(others) == {6.0, 7.0}
    commit(state, [op("monitor-threshold", "vibration_alert", delete=True, scope=Scope(share=0.2))])
    assert state.get("monitor-threshold", "vibration_alert", entity="m-1") == 7.0
    with pytest.raises(ValueError, match="exactly one"):
        Scope(prefix="a", share=0.1)


def test_snapshot_and_restore_round_trip() -> None:
    state = ConfigState()
    commit(state, [op("monitor-threshold", "error_rate_alert", 0.02), op("feature-switch", "a", True),
                   op("monitor-threshold", "t", 1.0, scope=Scope(prefix="dev-1"))])
    snap = state.snapshot("before-cleanup", "alice", "")
    good = state.cells()
    commit(state, state.delete_ops("monitor-threshold", "error_rate_alert"))  # the seeds' incident
    commit(state, [op("feature-switch", "a", False), op("feature-switch", "b", True),
                   op("monitor-threshold", "t", delete=True, scope=Scope(prefix="dev-1"))])
    commit(state, state.restore_ops(snap), reason="restore before-cleanup")
    assert state.cells() == good and state.version == 4
    commit(state, [op("feature-switch", "a", False)])
    commit(state, state.restore_ops(state.at(2)))
    assert state.cells() == state.at(2).cells()


def test_a_processor_can_declare_the_schema_of_its_own_keys() -> None:
    schemas = ConfigSchemas().with_declaration(
        Declaration("business-rule", "strict.*", "streams.config_center.schemas:RuleSetConfig", "strict rule set"))
    with pytest.raises(ConfigValidationError, match="strict rule set"):
        ConfigState(schemas=schemas).prepare([op("business-rule", "strict.pm", {"rules": "x"})], "a", "")
