import json

import pytest

from streams.ingest import IngestSettings, Rejected, Validator
from reference import load_schema

NOW = 1_800_000_000_000


@pytest.fixture
def validator():
    settings = IngestSettings(entity_field="device_id", time_field="ts", max_record_bytes=512, ranges={"vibration": (0.0, 100.0)}, dedup_window=3)
    return Validator(load_schema("pm.ingest.telemetry-value"), settings)


def reading(**over):
    base = {"event_id": "e1", "device_id": "dev-1", "ts": NOW, "temperature": 60.0, "vibration": 2.0,
            "current": 12.0, "pressure": 5.0, "rpm": 1500.0}
    base.update(over)
    return json.dumps(base).encode()


def test_valid_reading_fills_missing_optional_sensors(validator):
    raw = json.loads(reading())
    del raw["rpm"]
    record = validator.validate(b"dev-1", json.dumps(raw).encode(), NOW)
    assert record["rpm"] is None and record["temperature"] == 60.0


@pytest.mark.parametrize(
    "key, value, reason, words",
    [
        (b"dev-1", None, "empty", "no value"),
        (b"dev-1", b"x" * 600, "oversize", "600 bytes"),
        (b"\xff\xfe", reading(), "bad_key", "UTF-8"),
        (b"dev-1", b"\xff" + reading(), "not_utf8", "UTF-8"),
        # Confluent-framed Avro (magic 0, schema id 7, an Avro string) where JSON is declared: says what it is
        (b"dev-1", b"\x00\x00\x00\x00\x07\x0adev-1", "avro_on_json_topic", "schema id 7"),
        (b"dev-1", b"\x00\x00\x00\x00\x07\xc3\x28", "avro_on_json_topic", "declared JSON"),
        (b"dev-1", reading()[:-5], "bad_json", "not JSON"),
        (b"dev-1", b"[1, 2]", "bad_json", "list"),
        (b"dev-1", reading(temperature="hot"), "schema", "temperature"),
        (b"dev-1", reading(colour="red"), "schema", "colour"),
        (b"dev-1", json.dumps({"event_id": "e", "ts": NOW}).encode(), "schema", "device_id"),
        (b"dev-1", reading(vibration=1e6), "out_of_range", "vibration"),
        (b"dev-2", reading(), "key_mismatch", "dev-2"),
        (b"dev-1", reading(ts=NOW + 120_000), "future_timestamp", "120.0s in the future"),
        (b"dev-1", reading(ts=NOW - 7_200_000), "too_old", "old"),
    ],
)
def test_each_breach_is_rejected_with_its_reason(validator, key, value, reason, words):
    with pytest.raises(Rejected) as info:
        validator.validate(key, value, NOW)
    assert info.value.reason == reason
    assert words in str(info.value)


def test_dedup_window_remembers_recent_event_ids(validator):
    def duplicate(event_id: str) -> bool:  # as admit: a duplicate is dropped, a new reading remembered
        if validator.memory.seen(event_id):
            return True
        validator.memory.remember(event_id, None, None)
        return False

    assert [duplicate(e) for e in ["a", "b", "a", "c", "d", "e", "a"]] == [
        False, False, True, False, False, False, False]


def test_input_quality_is_counted_per_field():
    from prometheus_client import REGISTRY

    v = Validator(load_schema("pm.ingest.telemetry-value"), IngestSettings(entity_field="device_id", time_field="ts", ranges={"vibration": (0.0, 100.0)}), "quality")

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, {"stream": "quality", **labels}) or 0.0

    v.admit(b"dev-1", reading(event_id="q1", rpm=None), NOW)
    with pytest.raises(Rejected):
        v.admit(b"dev-1", reading(event_id="q2", vibration=1e6), NOW)
    with pytest.raises(Rejected):
        v.admit(b"dev-1", reading(event_id="q3", temperature="hot"), NOW)
    assert sample("tangram_ingest_field_missing_total", field="rpm") == 1
    assert sample("tangram_ingest_field_missing_total", field="temperature") == 0
    assert sample("tangram_ingest_field_rejected_total", field="vibration", reason="out_of_range") == 1
    assert sample("tangram_ingest_field_rejected_total", field="temperature", reason="schema") == 1
