"""The Kafka ingest path on the real broker and registry: Avro poison pills, rate limits."""

from __future__ import annotations

import io
import json
import struct
import threading
import time
import uuid

import fastavro
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from streams.avro import codec
from streams.wire import plain
from streams.ingest import REJECTED
from streams.run import make_runner
from reference import load_schema

from gateway_helpers import headers, ingest_topology, read_topic

pytestmark = pytest.mark.integration

SUBJECT = "pm.ingest.telemetry-value"


def reading(device: str, i: int) -> dict:
    return {"event_id": f"{device}-{i}-{uuid.uuid4().hex[:6]}", "device_id": device, "ts": int(time.time() * 1000),
            "temperature": 60.0, "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0}


def run_until(runner, done, timeout_s: float = 60.0) -> None:
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        runner.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_avro_poison_pills_land_in_the_dlq_once_and_valid_records_flow_in_order(stack, tmp_path):
    topology, prefix = ingest_topology(tmp_path, stack, input_format="avro")
    raw, out, dlq = f"{prefix}.raw.telemetry", f"{prefix}.ingest.telemetry", f"{prefix}.dlq.ingest"
    contract = codec(stack.registry_url, SUBJECT, load_schema(SUBJECT))
    # a producer registered its own, different contract: temperature as a string
    wrong = json.loads(json.dumps(load_schema(SUBJECT)))
    wrong["fields"] = [f if f["name"] != "temperature" else {"name": "temperature", "type": "string"} for f in wrong["fields"]]
    wrong_id = SchemaRegistryClient({"url": stack.registry_url}).register_schema(f"{prefix}.wrong-value", Schema(json.dumps(wrong), "AVRO"))

    def framed(schema_id: int, schema: dict, record: dict) -> bytes:
        buf = io.BytesIO()
        buf.write(struct.pack(">bI", 0, schema_id))
        fastavro.schemaless_writer(buf, fastavro.parse_schema(plain(schema)), record)
        return buf.getvalue()

    good = contract.encode(reading("dev-p", 0))
    poison = [  # (value, key, reason)
        (good[:-4], b"dev-p", "truncated"),
        (b"\x07" + good[1:], b"dev-p", "bad_magic"),
        (b"\x00\x7f\xff\xff\x00" + good[5:], b"dev-p", "unknown_schema"),
        (framed(wrong_id, wrong, {**reading("dev-p", 0), "temperature": "hot"}), b"dev-p", "schema"),
        (good + b"\x00" * 1100, b"dev-p", "oversize"),
        (good, b"\xff\xfe", "bad_key"),
    ]
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True})
    valid = []
    for i in range(24):
        r = reading("dev-p", i)
        valid.append(r["event_id"])
        producer.produce(raw, contract.encode(r), "dev-p")
        if i % 4 == 1:
            value, key, _ = poison[i // 4]
            producer.produce(raw, value, key)
    assert producer.flush(10) == 0

    runner = make_runner(topology, "ingest", stack)
    counted = {reason: REJECTED.labels("ingest", reason)._value.get() for _, _, reason in poison}
    run_until(runner, lambda: len(read_topic(stack, dlq, idle_s=0.1)) >= len(poison)
              and len(read_topic(stack, out, idle_s=0.1)) >= len(valid))

    ingested = read_topic(stack, out)
    assert [contract.decode(m.value())["event_id"] for m in ingested] == valid  # all, once, in order
    dead = read_topic(stack, dlq)
    assert sorted(headers(m)["dlq.reason"] for m in dead) == sorted(r for _, _, r in poison)  # each exactly once
    by_reason = {headers(m)["dlq.reason"]: m for m in dead}
    for value, key, reason in poison:
        assert by_reason[reason].value() == value and by_reason[reason].key() == key  # original bytes untouched
        h = headers(by_reason[reason])
        assert h["dlq.source_topic"] == raw and int(h["dlq.source_offset"]) >= 0 and h["dlq.stage"] == "ingest"
        assert REJECTED.labels("ingest", reason)._value.get() == counted[reason] + 1
    assert "temperature" in headers(by_reason["schema"])["dlq.error_message"]


def test_a_flood_beyond_the_device_rate_limit_is_throttled_and_counted(stack, tmp_path):
    topology, prefix = ingest_topology(tmp_path, stack,
                                       params={"rate_limits": {"per_device": {"rate_per_s": 20, "burst": 10}}})
    raw, out, dlq = f"{prefix}.raw.telemetry", f"{prefix}.ingest.telemetry", f"{prefix}.dlq.ingest"
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 50})
    for i in range(200):  # a flood from one device: 200 readings within ~0.1 s
        producer.produce(raw, json.dumps(reading("dev-flood", i)).encode(), "dev-flood")
    for i in range(5):  # a well-behaved device beside it
        producer.produce(raw, json.dumps(reading("dev-calm", i)).encode(), "dev-calm")
    assert producer.flush(10) == 0
    before = REJECTED.labels("ingest", "rate_limited")._value.get()
    runner = make_runner(topology, "ingest", stack)
    run_until(runner, lambda: len(read_topic(stack, out, idle_s=0.1)) + len(read_topic(stack, dlq, idle_s=0.1)) >= 205)

    ingested = read_topic(stack, out)
    dead = read_topic(stack, dlq)
    flood_ok = sum(1 for m in ingested if m.key() == b"dev-flood")
    assert len(ingested) + len(dead) == 205  # nothing dropped silently
    assert sum(1 for m in ingested if m.key() == b"dev-calm") == 5
    assert 10 <= flood_ok <= 20, flood_ok  # the burst, plus what the rate refilled while the flood was produced
    assert {headers(m)["dlq.reason"] for m in dead} == {"rate_limited"}
    assert "device 'dev-flood'" in headers(dead[0])["dlq.error_message"]
    assert REJECTED.labels("ingest", "rate_limited")._value.get() - before == len(dead)
