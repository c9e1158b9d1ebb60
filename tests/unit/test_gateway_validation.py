"""The shared validation path: rate limits, dedup, batches, the Avro input path (no broker)."""

import io
import json
import struct

import fastavro
import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError

from streams.wire import WireFormatError, plain
from streams.ingest import REJECTED, IngestSettings, Rejected, TokenBuckets, TokenBucketSettings, Validator
from reference import load_schema

NOW = 1_800_000_000_000
SCHEMA = load_schema("pm.ingest.telemetry-value")


def reading(**over):
    base = {"event_id": "e1", "device_id": "dev-1", "ts": NOW, "temperature": 60.0, "vibration": 2.0,
            "current": 12.0, "pressure": 5.0, "rpm": 1500.0}
    base.update(over)
    return base


def make(**settings):
    return Validator(SCHEMA, IngestSettings(**{"entity_field": "device_id", "time_field": "ts", **settings}), name="unit")


def rejected_count(reason):
    return REJECTED.labels("unit", reason)._value.get()


def test_token_bucket_allows_the_burst_then_the_rate():
    buckets = TokenBuckets(TokenBucketSettings(rate_per_s=10, burst=5), max_keys=10)
    assert buckets.shortfall("a", 5, 0.0) == 0
    buckets.take("a", 5)
    assert buckets.shortfall("a", 1, 0.0) == pytest.approx(0.1)
    assert buckets.shortfall("a", 1, 0.1) == 0  # refilled by one token
    assert buckets.shortfall("a", 6, 0.1) == float("inf")  # more than the burst can never pass
    assert buckets.shortfall("b", 5, 0.0) == 0  # keys are independent


def test_token_buckets_forget_the_least_recently_used_key():
    buckets = TokenBuckets(TokenBucketSettings(rate_per_s=1, burst=1), max_keys=2)
    for key in ("a", "b", "c"):
        buckets.shortfall(key, 1, 0.0)
        buckets.take(key, 1)
    assert buckets.shortfall("a", 1, 0.0) == 0  # forgotten, so full again
    assert buckets.shortfall("c", 1, 0.0) > 0


def test_per_device_flood_is_rate_limited_and_counted():
    v = make(rate_limits={"per_device": {"rate_per_s": 10, "burst": 3}})
    before = rejected_count("rate_limited")
    outcomes = []
    for i in range(6):
        try:
            v.admit(b"dev-1", json.dumps(reading(event_id=f"e{i}")).encode(), NOW, now_s=100.0)
            outcomes.append("ok")
        except Rejected as exc:
            outcomes.append(exc.reason)
            assert "device 'dev-1'" in str(exc) and exc.retry_after_s == pytest.approx(0.1)
    assert outcomes == ["ok"] * 3 + ["rate_limited"] * 3
    assert rejected_count("rate_limited") - before == 3
    # a second later the device may send again; another device was never limited
    assert v.admit(b"dev-1", json.dumps(reading(event_id="late")).encode(), NOW, now_s=101.0) is not None
    assert v.admit(b"dev-2", json.dumps(reading(event_id="x", device_id="dev-2")).encode(), NOW, now_s=100.0)


def test_a_rate_limited_reading_is_not_remembered_so_its_retry_is_not_a_duplicate():
    v = make(rate_limits={"per_client": {"rate_per_s": 1, "burst": 1}})
    v.admit(None, json.dumps(reading(event_id="a")).encode(), NOW, client="c", now_s=0.0)
    with pytest.raises(Rejected, match="client 'c'"):
        v.admit(None, json.dumps(reading(event_id="b")).encode(), NOW, client="c", now_s=0.0)
    assert v.admit(None, json.dumps(reading(event_id="b")).encode(), NOW, client="c", now_s=1.0)["event_id"] == "b"
    assert v.admit(None, json.dumps(reading(event_id="b")).encode(), NOW, client="c", now_s=9.0) is None  # now a duplicate


def test_batch_is_all_or_nothing_for_contract_breaches():
    v = make()
    verdict = v.admit_batch([reading(event_id="a"), reading(event_id="b", temperature="hot"), {"x": 1}], NOW, now_s=0)
    assert not verdict.accepted
    assert [(i, e.reason, e.field) for i, e in verdict.rejected] == [(1, "schema", "temperature"), (2, "schema", "x")]
    assert not v.memory.seen("a")  # nothing of a refused batch is remembered


def test_batch_counts_duplicates_and_throttles_as_a_whole():
    v = make(rate_limits={"per_client": {"rate_per_s": 1, "burst": 3}})
    verdict = v.admit_batch([reading(event_id="a"), reading(event_id="a"), reading(event_id="b")], NOW, client="c", now_s=0)
    assert [r["event_id"] for _, r in verdict.accepted] == ["a", "b"] and verdict.duplicates == 1
    verdict = v.admit_batch([reading(event_id="c"), reading(event_id="d")], NOW, client="c", now_s=0)
    assert not verdict.accepted and verdict.throttled.reason == "rate_limited"
    assert verdict.throttled.retry_after_s == pytest.approx(1.0)
    verdict = v.admit_batch([reading(event_id=str(i)) for i in range(4)], NOW, client="c", now_s=50)
    assert verdict.throttled.retry_after_s is None  # larger than the burst: can never pass
    v.forget([reading(event_id="a")])
    assert not v.memory.seen("a") and v.memory.seen("b")


def test_batch_checks_each_readings_size():
    v = make(max_record_bytes=128)
    verdict = v.admit_batch([reading()], NOW, sizes=[500])
    assert verdict.rejected[0][1].reason == "oversize"


def test_out_of_order_per_device():
    v = make(max_out_of_order_ms=1000)
    v.admit(b"dev-1", json.dumps(reading(event_id="a", ts=NOW)).encode(), NOW)
    v.admit(b"dev-1", json.dumps(reading(event_id="b", ts=NOW - 900)).encode(), NOW)
    with pytest.raises(Rejected) as info:
        v.admit(b"dev-1", json.dumps(reading(event_id="c", ts=NOW - 1500)).encode(), NOW)
    assert info.value.reason == "out_of_order" and info.value.field == "ts"
    v.admit(b"dev-2", json.dumps(reading(event_id="d", device_id="dev-2", ts=NOW - 1500)).encode(), NOW)


class FakeRegistry:
    """Answers schema ids like the registry client: 7 is a writer with an extra field, others are unknown."""

    def __init__(self):
        extra = dict(SCHEMA, fields=[*SCHEMA["fields"], {"name": "site", "type": "string", "default": ""}])
        wrong = dict(SCHEMA, fields=[f if f["name"] != "temperature" else {"name": "temperature", "type": "string"}
                                     for f in SCHEMA["fields"]])
        self.schemas = {7: fastavro.parse_schema(plain(extra)), 8: fastavro.parse_schema(plain(wrong))}

    def parsed(self, schema_id):
        if schema_id not in self.schemas:
            raise WireFormatError(f"unknown schema id {schema_id}") from SchemaRegistryError(404, 40403, "Schema not found")
        return self.schemas[schema_id]


class FakeCodec:
    schema_id = 1

    def __init__(self):
        self.schema = fastavro.parse_schema(plain(SCHEMA))
        self.registry = FakeRegistry()


def framed(schema_id, schema, record):
    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, schema_id))
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


@pytest.mark.parametrize("case, reason", [
    ("truncated", "truncated"), ("header only", "truncated"), ("wrong magic", "bad_magic"),
    ("unknown id", "unknown_schema"), ("wrong types", "schema"), ("trailing", "bad_avro"), ("oversize", "oversize"),
    ("bad key", "bad_key"),
])
def test_avro_poison_reasons(case, reason):
    v, codec = make(max_record_bytes=256), FakeCodec()
    good = framed(1, codec.schema, reading())
    value, key = {
        "truncated": (good[:-3], b"dev-1"),
        "header only": (good[:3], b"dev-1"),
        "wrong magic": (b"\x01" + good[1:], b"dev-1"),
        "unknown id": (b"\x00\x00\x00\x03\xe7" + good[5:], b"dev-1"),
        "wrong types": (framed(8, codec.registry.schemas[8], reading(temperature="hot")), b"dev-1"),
        "trailing": (good + b"\x00", b"dev-1"),
        "oversize": (good + b"x" * 300, b"dev-1"),
        "bad key": (good, b"\xff\xfe"),
    }[case]
    with pytest.raises(Rejected) as info:
        v.validate_avro(key, value, NOW, codec)
    assert info.value.reason == reason


def test_avro_reads_a_compatible_writer_into_the_contract():
    v, codec = make(), FakeCodec()
    record = v.validate_avro(b"dev-1", framed(7, codec.registry.schemas[7], {**reading(), "site": "A"}), NOW, codec)
    assert record["event_id"] == "e1" and "site" not in record


def test_registry_outage_is_not_taken_for_a_bad_record():
    v, codec = make(), FakeCodec()

    def down(schema_id):
        raise WireFormatError("registry unreachable") from SchemaRegistryError(503, 50301, "unavailable")

    codec.registry.parsed = down
    with pytest.raises(WireFormatError):
        v.validate_avro(b"dev-1", framed(7, codec.registry.schemas[7], {**reading(), "site": "A"}), NOW, codec)


@pytest.mark.parametrize("field, value, ok", [
    ("temperature", 1, True), ("temperature", None, True), ("temperature", True, False), ("temperature", "1", False),
    ("ts", 2**63, False), ("ts", 1.5, False), ("event_id", 5, False), ("device_id", None, False),
])
def test_fast_type_checks_agree_with_fastavro(field, value, ok):
    record = {**reading(), field: value}
    fast_ok = True
    try:
        make(max_age_ms=10**15, max_future_skew_ms=10**15).validate_reading(record, None, NOW)
    except Rejected as exc:
        fast_ok = False
        assert exc.field == field
    schema = fastavro.parse_schema(plain(SCHEMA))
    assert fast_ok == ok == fastavro.validate(record, schema, raise_errors=False)
