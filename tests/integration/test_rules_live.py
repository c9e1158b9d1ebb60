"""The rule processor on real Kafka (and Redis): semantics, cooldown and dedup, replay ids, fusion, hot reload."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from streams.config_center import ConfigCenter

from rules_helpers import Actions, Feed, InProcess, prediction, rules_topology

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000
RULES = [
    {"name": "bearing", "when": "label == 'bearing_wear' and confidence >= 0.8", "action": "maintenance", "priority": 5},
    {"name": "bearing_unsure", "when": "label == 'bearing_wear' and confidence < 0.8", "action": "review"},
    {"name": "any_anomaly", "when": "score > 0.5", "action": "maintenance", "priority": 1},
    {"name": "hot", "when": "label == 'overheating' and score > 0.9", "action": "alert"},
]

# (device, label, score) → the rules expected to fire (table-driven, through Kafka)
TABLE = [
    ("d-bearing", "bearing_wear", 0.95, {"bearing"}),  # any_anomaly also matches: lower priority, same type
    ("d-unsure", "bearing_wear", 0.7, {"bearing_unsure", "any_anomaly"}),
    ("d-hot", "overheating", 0.97, {"hot", "any_anomaly"}),
    ("d-warm", "overheating", 0.6, {"any_anomaly"}),
    ("d-healthy", "healthy", 0.02, set()),
]


def test_rules_table_cooldown_dedup_and_explainable_actions(stack, tmp_path):
    topology, _, prefix = rules_topology(tmp_path, stack, rules=RULES, cooldown_ms=10_000)
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    with InProcess(topology, "rules", stack):
        first = [prediction(d, T0, label, score) for d, label, score, _ in TABLE]
        feed.predict(first)
        feed.predict(first[:1])  # the same prediction again (a re-delivery): deduplicated
        feed.predict([prediction("d-bearing", T0 + 5000), prediction("d-bearing", T0 + 15_000)])  # in, past cooldown
        actions.until(lambda seen: any(a["window_end"] == T0 + 15_000 for a in seen))
        seen = actions.settle()
    fired = {(a["device_id"], a["window_end"]): set() for a in seen}
    for a in seen:
        fired[(a["device_id"], a["window_end"])].add(a["rule"])
    for device, _, _, expected in TABLE:
        assert fired.get((device, T0), set()) == expected, (device, fired)
    assert (("d-bearing", T0 + 5000)) not in fired  # within the 10 s cooldown of the same action type
    assert fired[("d-bearing", T0 + 15_000)] == {"bearing"}
    assert len(seen) == len({a["event_id"] for a in seen}) == 7  # nothing doubled
    action = next(a for a in seen if a["rule"] == "bearing" and a["window_end"] == T0)
    assert action["_topic"] == f"{prefix}.actions.maintenance" and action["degradation_level"] == "L0"
    assert action["model_versions"] == {"anomaly": "1"} and action["rule_set"] == "topology"
    assert action["inputs"] == {"confidence": 0.95} and "confidence=0.95" in action["reason"]
    actions.close()


def test_replaying_an_input_range_twice_yields_identical_action_ids(stack, tmp_path):
    topology, _, prefix = rules_topology(tmp_path, stack, rules=RULES, cooldown_ms=12_000)
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    rows = [prediction(f"d-{i % 7}", T0 + 5000 * (i // 7), ["bearing_wear", "overheating", "healthy"][i % 3],
                       0.5 + (i % 50) / 100) for i in range(140)]
    feed.predict(rows)
    runs = []
    for replay in ("first", "second"):
        with InProcess(topology, "rules", stack, group=f"{prefix}.replay-{replay}"):
            before = len(actions.seen)
            actions.until(lambda seen: len(seen) > before, 30)
            actions.settle(quiet_s=3.0)
            runs.append(sorted(a["event_id"] for a in actions.seen[before:]))
    assert runs[0] and runs[0] == runs[1], (len(runs[0]), len(runs[1]))
    print(f"\nreplay: {len(rows)} predictions → {len(runs[0])} actions, identical ids in both runs")
    actions.close()


def test_fusion_with_a_missing_member_emits_after_the_wait_and_says_so(stack, tmp_path):
    fusion = {"members": [{"model": "anomaly", "weight": 2}, {"model": "gbt", "weight": 1}], "method": "weighted",
              "wait_ms": 1500}
    topology, _, prefix = rules_topology(tmp_path, stack, rules=RULES[:1], cooldown_ms=0, fusion=fusion)
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    with InProcess(topology, "rules", stack):
        feed.predict([prediction("d-both", T0, score=0.9), prediction("d-both", T0, score=0.85, model="gbt", version="3"),
                      prediction("d-alone", T0, score=0.92)])
        started = time.monotonic()
        actions.until(lambda seen: {a["device_id"] for a in seen} == {"d-both", "d-alone"}, 20)
        waited = time.monotonic() - started
        feed.predict([prediction("d-alone", T0, score=0.99, model="gbt")])  # too late: the window was decided
        seen = actions.settle(quiet_s=2.5)
    both = next(a for a in seen if a["device_id"] == "d-both")
    alone = next(a for a in seen if a["device_id"] == "d-alone")
    assert both["missing_models"] == [] and both["model_versions"] == {"anomaly": "1", "gbt": "3"}
    assert both["score"] == pytest.approx((0.9 * 2 + 0.85) / 3)
    assert alone["missing_models"] == ["gbt"] and alone["model_versions"] == {"anomaly": "1"}
    assert "missing gbt after 1500 ms" in alone["reason"]
    assert len(seen) == 2 and waited >= 1.0
    actions.close()


def test_a_rule_change_under_load_loses_and_doubles_no_action(stack, tmp_path):
    one = [{"name": "every_v1", "when": "score >= 0", "action": "review"}]
    topology, _, prefix = rules_topology(tmp_path, stack, rules=one, cooldown_ms=0)
    center = ConfigCenter(stack.kafka, f"_tangram.config.{prefix}")
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    n_devices, n_windows = 20, 100
    with InProcess(topology, "rules", stack) as proc:
        def load() -> None:
            for w in range(n_windows):
                feed.predict([prediction(f"d-{d}", T0 + 5000 * w, score=0.3) for d in range(n_devices)])
                time.sleep(0.02)

        producer = threading.Thread(target=load)
        producer.start()
        actions.until(lambda seen: len(seen) >= 300, 60)
        applied = center.set("business-rule", f"{prefix}.rules",
                             {"rules": [{"name": "every_v2", "when": "score >= 0", "action": "review"}]},
                             "test", "rule change under load")
        producer.join(120)
        actions.until(lambda seen: len(seen) >= n_devices * n_windows, 60)
        seen = actions.settle(quiet_s=2.0)
        version = proc.processor.book.source
    per_window = Counter((a["device_id"], a["window_end"]) for a in seen)
    assert len(per_window) == n_devices * n_windows and set(per_window.values()) == {1}  # none lost, none doubled
    by_rule = Counter((a["rule"], a["rule_set"]) for a in seen)
    assert set(by_rule) == {("every_v1", "topology"), ("every_v2", f"config v{applied.version}")}, by_rule
    assert version == f"config v{applied.version}"
    print(f"\nrule change under load: {dict(by_rule)}")
    actions.close()


def test_a_malformed_rule_set_is_refused_at_publish(stack, tmp_path):
    center = ConfigCenter(stack.kafka, f"_tangram.config.refuse{time.time_ns()}")
    from streams.errors import ConfigValidationError

    with pytest.raises(ConfigValidationError, match=r"rule 'oops' \(#1 of its rule set\): syntax error at position 9"):
        center.set("business-rule", "pm.rules", {"rules": [{"name": "oops", "when": "score >> > 1", "action": "x"}]})
    assert center.refresh().version == 0
