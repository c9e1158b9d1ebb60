"""The rule processor decides a batch read as columns exactly as it decides the same records one by one.

A batch of at least ``SMALL_BATCH`` predictions of one topic is decoded as columns and every rule runs over
all of it at once (``Evaluation.evaluate_columns``); smaller batches go record by record. The same
records, fed once as one batch and once in batches too small for columns, must give the same outputs,
byte for byte and in the same order: actions, cooldowns and priorities held back, dead letters for rules
that cannot be evaluated (NaN, a null online feature, an entity without online features).
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from reference import load_schema
from streams.avro import SMALL_BATCH, AvroCodec
from streams.delivery import Record
from streams.features.layout import FeastLayout
from streams.features.online import OnlineRows
from streams.rules import RuleSpec, RulesSettings
from streams.rules.online_reads import ROW_POLL_S
from streams.rules.processor import RuleProcessor
from streams.wire import parse

SUBJECTS = ["pm.predictions.anomaly-value", "pm.features.device_window-value", "pm.actions.maintenance-value",
            "pm.actions.alert-value", "pm.actions.review-value"]
TOPICS = {"maintenance": "pm.actions.maintenance", "alert": "pm.actions.alert", "review": "pm.actions.review"}


class FakeRegistry:
    """The registry as a codec sees it: one id per subject, each id's schema."""

    ids = {subject: i for i, subject in enumerate(SUBJECTS, start=1)}

    def lookup(self, subject: str, text: str) -> int:
        return self.ids[subject]

    def parsed(self, schema_id: int) -> Any:
        return parse(load_schema(SUBJECTS[schema_id - 1]))


def codec(subject: str) -> AvroCodec:
    return AvroCodec(FakeRegistry(), subject, load_schema(subject))  # type: ignore[arg-type]


RULES = [
    RuleSpec(name="bearing_wear", when="label == 'bearing_wear' and confidence >= 0.8", action="maintenance",
             priority=10),
    RuleSpec(name="bearing_wear_score", when="score > 0.9", action="maintenance", priority=5),  # held back by priority
    RuleSpec(name="overheating", when="label == 'overheating' and confidence >= 0.8", action="alert", priority=10,
             cooldown_s=0),
    RuleSpec(name="poor_data", when="missing_rate > 0.3", action="review"),
]


class Processor(RuleProcessor):
    """The rule processor with its online store replaced by a table: the Redis script's replies are made from
    it in Feast's layout (``OnlineRows``, as ``read_online_rows`` returns them)."""

    def __init__(self, online: dict[str, dict], online_wait_ms: int = 0):
        # no wait for rows by default: an entity without online features is decided (dead-lettered) at once here
        settings = RulesSettings(rules=RULES, entity_field="device_id", time_field="window_end", actions=TOPICS,
                                 cooldown_ms=20_000, features_from="features", live_config=False,
                                 online_wait_ms=online_wait_ms)
        layout = FeastLayout(project="pm", feature_view="device_window", join_key="device_id",
                             event_time_field="window_end", int_fields=("window_end",),
                             double_fields=("missing_rate",), key_ttl_s=None)
        super().__init__(input_codecs={"pm.predictions.anomaly": codec(SUBJECTS[0]),
                                       "pm.features.device_window": codec(SUBJECTS[1])},
                         output_codecs={t: codec(f"{t}-value") for t in TOPICS.values()}, dlq_topic="pm.dlq.rules",
                         redis_url="redis://127.0.0.1:1/0", settings=settings, app="pm", online=layout)
        self.table = online
        self.columns_batches = 0
        evaluate_columns = self.evaluation.evaluate_columns

        def counted(*args, **kwargs):
            self.columns_batches += 1
            return evaluate_columns(*args, **kwargs)
        self.evaluation.evaluate_columns = counted  # type: ignore[method-assign]

    def _read_online(self, entities: list[str]) -> OnlineRows:
        layout, unique = self.online.layout, list(dict.fromkeys(entities))
        replies = []
        for e in unique:
            row = self.table.get(e)
            stored = layout.encode_row(row) if row is not None else {}
            replies.append([stored.get(field) for field in layout.read_fields])
        return OnlineRows(layout, unique, replies)


def predictions(n: int, devices: int, seed: int) -> list[Record]:
    rng = random.Random(seed)
    enc = codec(SUBJECTS[0])
    records = []
    for i in range(n):
        device = f"dev-{rng.randrange(devices)}"
        label = rng.choice(["healthy", "healthy", "bearing_wear", "overheating"])
        confidence = rng.choice([0.5, 0.79, 0.8, 0.95, 1.0, math.nan])
        value = {"event_id": f"e{i}", "device_id": device, "window_start": 5000 * (i // 4),
                 "window_end": 5000 * (i // 4) + 5000, "score": rng.random(), "label": label, "confidence": confidence,
                 "probabilities": {"healthy": 0.5, "bearing_wear": 0.25, "overheating": 0.25}, "model_name": "anomaly",
                 "model_version": "1", "inference_ms": 2.0, "trace_id": f"t{i}"}
        records.append(Record("pm.predictions.anomaly", i % 3, i, device.encode(), enc.encode(value), {}, 0))
    return records


def outputs(processor: RuleProcessor, records: list[Record], size: int) -> list[tuple]:
    out = []
    for start in range(0, len(records), size):
        out += [(o.topic, o.key, o.value, {k: v for k, v in o.headers.items() if k != "dlq.failed_ms"})  # the clock
                for o in processor.process(records[start:start + size])]
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_batch_as_columns_decides_what_the_records_one_by_one_decide(seed):
    rng = random.Random(seed)
    online = {}
    for d in range(40):
        if d % 7 == 0:
            continue  # no online features: the rule reading them cannot be evaluated (a dead letter)
        online[f"dev-{d}"] = {"window_end": 5000, "missing_rate": None if d % 11 == 0 else rng.choice([0.0, 0.2, 0.5])}
    records = predictions(600, 40, seed)
    by_columns, one_by_one = Processor(online), Processor(online)
    batched = outputs(by_columns, records, 300)
    single = outputs(one_by_one, records, SMALL_BATCH - 1)
    assert by_columns.columns_batches == 2 and one_by_one.columns_batches == 0
    assert batched == single
    topics = {t for t, *_ in batched}
    assert topics == {*TOPICS.values(), "pm.dlq.rules"}, topics  # every kind of output was exercised
    reasons = {h.get("dlq.reason") for t, _, _, h in batched if t == "pm.dlq.rules"}
    assert reasons == {"rule_missing_input", "rule_unevaluable"}, reasons


def count_decodes(monkeypatch) -> list[bytes]:
    """From now on, the values ``AvroCodec.decode`` is given, in a list."""
    decoded: list[bytes] = []
    original = AvroCodec.decode

    def counting(self, data):
        decoded.append(data)
        return original(self, data)

    monkeypatch.setattr(AvroCodec, "decode", counting)
    return decoded


def test_a_batch_that_fires_nothing_decodes_no_record_on_its_own(monkeypatch):
    """The columns decide it: no record's value is built (the cost the column path saves)."""
    records = [r for r in predictions(400, 40, 4)]
    processor = Processor({f"dev-{d}": {"window_end": 5000, "missing_rate": 0.0} for d in range(40)})
    quiet = [r for r in records if _label(r) == "healthy" and _score(r) <= 0.9]
    assert len(quiet) >= SMALL_BATCH
    decoded = count_decodes(monkeypatch)
    assert processor.process(quiet) == []
    assert decoded == [] and processor.columns_batches == 1


def test_a_batch_whose_rules_fire_builds_its_actions_from_the_columns(monkeypatch):
    """An action's fields (the prediction's label, score, model, trace) come from the batch's columns too: the rows
    that fire are not decoded one by one either, and the actions are the record path's (the test above)."""
    records = predictions(400, 40, 5)
    processor = Processor({f"dev-{d}": {"window_end": 5000, "missing_rate": 0.0} for d in range(40)})
    firing = [r for r in records if _label(r) != "healthy" and _value(r)["confidence"] >= 0.8]
    assert len(firing) >= SMALL_BATCH
    decoded = count_decodes(monkeypatch)
    actions = processor.process(firing)
    assert actions and all(a.topic in TOPICS.values() for a in actions)
    assert decoded == [] and processor.columns_batches == 1


def _value(record: Record) -> dict:
    return codec(SUBJECTS[0]).decode(record.value)


def _label(record: Record) -> str:
    return _value(record)["label"]


def _score(record: Record) -> float:
    return _value(record)["score"]


def test_a_prediction_whose_entity_has_no_online_row_yet_waits_for_it_then_is_decided_without_it():
    """The feature stage writes a window's row after the broker acknowledged its batch, so a prediction can come
    first: the batch waits, reading the missing rows again every ``ROW_POLL_S``, only until the row lands, and is
    decided with it; an entity that still has none after ``online_wait_ms`` is decided without (a dead letter),
    and the batches after do not wait for it again."""
    clock, slept, decided = [100.0], [], [0]

    def sleep(seconds: float) -> None:
        assert rules.memory.windows == decided[0]  # nothing decided while the batch waits
        slept.append(seconds)
        clock[0] += seconds
        if len(slept) == 3:  # the feature stage wrote it meanwhile
            rules.table["dev-2"] = {"window_end": 5000, "missing_rate": 0.9}

    rules = Processor({"dev-1": {"window_end": 5000, "missing_rate": 0.9}}, online_wait_ms=2000)
    rules.online.clock, rules.online.sleep = (lambda: clock[0]), sleep
    batch = [r for r in predictions(40, 3, 7) if r.key in (b"dev-1", b"dev-2")]
    out = rules.process(batch)
    assert slept == [ROW_POLL_S] * 3  # no longer than the row took
    missing = [o for o in out if o.headers.get("dlq.reason") == "rule_missing_input"]  # (a NaN confidence: unevaluable)
    assert not missing and rules.online.rowless == {}
    assert {o.key for o in out if o.topic == TOPICS["review"]} == {"dev-1", "dev-2"}  # poor_data read the rows
    late = [r for r in predictions(40, 5, 8) if r.key == b"dev-4"]
    slept.clear()
    decided[0] = rules.memory.windows
    reasons = {o.headers.get("dlq.reason") for o in rules.process(late) if o.topic == "pm.dlq.rules"}
    assert reasons == {"rule_missing_input"} and sum(slept) == pytest.approx(2.0)  # waited out: decided without a row
    slept.clear()
    again = [r for r in predictions(40, 5, 9) if r.key == b"dev-4"]
    reasons = {o.headers.get("dlq.reason") for o in rules.process(again) if o.topic == "pm.dlq.rules"}
    assert reasons == {"rule_missing_input"} and not slept  # not waited for again
    rules.table["dev-4"] = {"window_end": 5000, "missing_rate": 0.9}
    rules.process([r for r in predictions(40, 5, 10) if r.key == b"dev-4"])
    assert rules.online.rowless == {}  # its row landed: a later absence (say, its key expired) is waited for again
