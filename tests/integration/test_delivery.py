"""At-least-once on the real broker: poison records never stall a partition, a kill -9 loses nothing."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from reference import REPO as PROJECT_ROOT
from streams.avro import codec
from streams.launcher import high_watermarks, uncommitted
from streams.testing import read_rows
from streams.plan import apply
from streams.run import make_runner
from streams.topology import load_topology
from reference import load_schema

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def reading(device: str, i: int) -> dict:
    return {"event_id": f"{device}-{i}-{uuid.uuid4().hex[:6]}", "device_id": device, "ts": int(time.time() * 1000),
            "temperature": 60.0, "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0}


def read_all(stack, topic: str, partitions: int, idle_s: float = 2.0, timeout_s: float = 60.0) -> list:
    """Every record of ``topic`` (raw messages), until nothing new arrived for ``idle_s``."""
    return read_rows(stack.kafka, topic, None, partitions, idle_s, timeout_s)


def wait_caught_up(stack, topology, group: str, topic: str, timeout_s: float = 90.0) -> None:
    """Until ``group`` has committed ``topic`` to its end: every record read, its outputs acknowledged (the loop
    commits only then). A count of the outputs cannot say so after kills: re-delivered duplicates add to it."""
    probe = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": "probe"})
    deadline = time.monotonic() + timeout_s
    short: dict | str = "not asked yet"
    try:
        while time.monotonic() < deadline:
            try:
                ends = {tp: end for tp, end in high_watermarks(probe, topology, [topic], timeout_s=5).items() if end}
                short = uncommitted(stack, group, ends)  # an empty partition has no commit: not asked
            except KafkaException as exc:  # e.g. the coordinator moving; ask again
                short = exc.args[0].str()
            if not short:
                return
            time.sleep(0.2)
    finally:
        probe.close()
    raise AssertionError(f"{group} has not committed {topic} to its end after {timeout_s}s: short {short}")


def wait_for_count(stack, topic: str, partitions: int, at_least: int, timeout_s: float = 60.0) -> int:
    probe = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": "probe"})
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                n = sum(probe.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1] for p in range(partitions))
            except KafkaException:  # e.g. a leader moving; ask again
                n = -1
            if n >= at_least:
                return n
            time.sleep(0.2)
    finally:
        probe.close()
    raise AssertionError(f"{topic} has fewer than {at_least} records after {timeout_s}s")


def test_poison_records_go_to_the_dlq_and_valid_ones_flow_in_order(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    raw, out, dlq = f"{prefix}.raw.telemetry", f"{prefix}.ingest.telemetry", f"{prefix}.dlq.ingest"
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True})
    poison = {
        "truncated": b'{"event_id": "x", "device_id": "dev-p", "ts": 1',
        "wrong type": json.dumps({**reading("dev-p", 0), "temperature": "hot"}).encode(),
        "not utf8": b"\xff\xfe\x00garbage",
        "oversize": json.dumps({**reading("dev-p", 0), "event_id": "x" * 5000}).encode(),
        "future": json.dumps({**reading("dev-p", 0), "ts": int(time.time() * 1000) + 3_600_000}).encode(),
    }
    valid, sent = [], []
    for i in range(30):
        r = reading("dev-p", i)
        valid.append(r["event_id"])
        producer.produce(raw, json.dumps(r).encode(), "dev-p")  # one key: one partition, one order
        if i % 6 == 3:
            name, value = list(poison.items())[i // 6]
            producer.produce(raw, value, "dev-p")
            sent.append(name)
    producer.produce(raw, json.dumps(reading("dev-p", 99)).encode(), b"\xff\xfe")  # non-UTF-8 key
    assert producer.flush(10) == 0

    runner = make_runner(topology, "ingest", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_for_count(stack, out, 3, len(valid))
        wait_for_count(stack, dlq, 3, len(poison) + 1)
    finally:
        runner.stop()
        thread.join(30)
    assert not thread.is_alive()
    # a loop embedded in a longer-lived process leaves its heap to the collector: once let go, the loop and its
    # Kafka clients are freed (`tangram run` alone freezes what setup built)
    assert gc.get_freeze_count() == 0
    gone = weakref.ref(runner)
    del runner
    gc.collect()
    assert gone() is None

    ingested = read_all(stack, out, 3)
    decoded = [codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value")).decode(m.value())
               for m in ingested]
    assert [r["event_id"] for r in decoded] == valid  # every valid reading, once, in order
    assert {m.partition() for m in ingested} == {ingested[0].partition()}
    headers = [dict(m.headers()) for m in ingested]
    assert all(h["event_id"] and len(h["trace_id"]) == 32 and int(h["ingest_ms"]) > 0 for h in headers)

    dead = read_all(stack, dlq, 3)
    reasons = sorted(dict(m.headers())["dlq.reason"].decode() for m in dead)
    assert reasons == sorted(["bad_json", "schema", "not_utf8", "oversize", "future_timestamp", "bad_key"])
    by_reason = {dict(m.headers())["dlq.reason"].decode(): m for m in dead}
    assert by_reason["bad_json"].value() == poison["truncated"]  # original bytes, untouched
    assert by_reason["not_utf8"].value() == poison["not utf8"]
    assert by_reason["bad_key"].key() == b"\xff\xfe"
    h = dict(by_reason["schema"].headers())
    assert h["dlq.source_topic"].decode() == raw and h["dlq.stage"] == b"ingest"
    assert "temperature" in h["dlq.error_message"].decode()
    assert int(h["dlq.source_offset"]) >= 0


def test_kill_9_mid_stream_loses_nothing(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    raw, out = f"{prefix}.raw.telemetry", f"{prefix}.ingest.telemetry"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "ingest.log").open("ab")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "streams", "run", str(path), "ingest"], cwd=PROJECT_ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    expected: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 5})
        i = 0
        while not stop.is_set():
            for device in ("dev-a", "dev-b", "dev-c", "dev-d"):
                r = reading(device, i)
                expected.append(r["event_id"])
                producer.produce(raw, json.dumps(r).encode(), device)
            i += 1
            producer.poll(0)
            time.sleep(0.002)
        assert producer.flush(10) == 0

    proc = start()
    feeder = threading.Thread(target=produce)
    feeder.start()
    kills = 0
    try:
        for _ in range(3):
            wait_for_count(stack, out, 3, at_least=500 * (kills + 1))
            os.killpg(proc.pid, signal.SIGKILL)  # no goodbye: no flush, no commit
            proc.wait()
            kills += 1
            proc = start()
        time.sleep(1)
        stop.set()
        feeder.join()
        wait_caught_up(stack, topology, topology.group("ingest"), raw)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    got = [dict(m.headers())["event_id"].decode() for m in read_all(stack, out, 3)]
    missing = set(expected) - set(got)
    duplicates = len(got) - len(set(got))
    print(f"\nkill -9 x{kills}: {len(expected)} readings sent, {len(set(got))} delivered, "
          f"{len(missing)} lost, {duplicates} duplicates (at-least-once)")
    assert not missing
