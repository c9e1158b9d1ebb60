"""Recorded inputs and row comparison for feature-engine tests and benchmarks.

``recorded_readings`` makes a deterministic telemetry recording from the simulator's
physics, with the disorder real fleets have: readings swapped within a window
(out of order), stragglers inside the allowed lateness, readings too late for any open
window, and dropped sensor values. ``produce_readings`` writes it to the ingest topic,
keyed by device; ``read_rows`` reads an output topic back as decoded rows keyed by
(entity, window_start); ``diff_rows`` names every difference between two engines' rows.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable

import numpy as np
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from streams.avro import AvroCodec
from streams.features.compute import FEATURE_SET, compute_window
from streams.features.spec import FeatureSet
from streams.simulator import SENSORS, Device

#: A window-aligned base time in the simulator's future-free past (2026-11-20).
BASE_MS = 1_795_000_000_000


def recorded_readings(n_devices: int, seconds: float, *, hz: float = 10.0, seed: int = 7,
                      late_every: int = 97, swap_every: int = 13, straggle_every: int = 41) -> list[dict]:
    """Telemetry readings (the ingest contract's fields) in arrival order, per device interleaved."""
    rng = np.random.default_rng(seed)
    faults = ("none", "bearing_wear", "overheating", "sensor_dropout")
    devices = [Device.random(f"dev-{i:05d}", rng, faults[i % len(faults)], onset_s=seconds / 3)
               for i in range(n_devices)]
    n = int(seconds * hz)
    t = np.arange(n) / hz
    per_device: list[list[dict]] = []
    for d in devices:
        values = d.sample(t, rng)
        rows = []
        for i in range(n):
            rows.append({"event_id": f"{d.device_id}-{i}", "device_id": d.device_id,
                         "ts": BASE_MS + round(t[i] * 1000),
                         **{s: None if math.isnan(values[i, j]) else float(values[i, j]) for j, s in enumerate(SENSORS)}})
        for i in range(swap_every, n - 1, swap_every):  # out of order within the stream
            rows[i], rows[i + 1] = rows[i + 1], rows[i]
        for i in range(straggle_every, n, straggle_every):  # a straggler 1.2 s behind: inside the allowed lateness
            rows.insert(i, {**rows[i - 12], "event_id": f"{d.device_id}-s{i}", "ts": rows[i]["ts"] - 1200})
        for i in range(late_every, len(rows), late_every):  # 9 s behind: its window is closed, it is late
            rows.insert(i, {**rows[i], "event_id": f"{d.device_id}-l{i}", "ts": rows[i]["ts"] - 9000})
        per_device.append(rows)
    out = []
    for i in range(max(len(r) for r in per_device)):
        out.extend(rows[i] for rows in per_device if i < len(rows))
    return out


def create_topics(bootstrap: str, topics: Iterable[str], partitions: int = 3) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(t, partitions, 1) for t in topics])
    for future in futures.values():
        future.result(30)


def produce_readings(bootstrap: str, topic: str, codec: AvroCodec, readings: list[dict]) -> None:
    """Produce the readings keyed by device, in order, and wait for every ack."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20,
                         "compression.type": "lz4"})
    for r in readings:
        while True:
            try:
                producer.produce(topic, codec.encode(r), r["device_id"],
                                 headers=[("event_id", r["event_id"].encode()), ("trace_id", r["event_id"].encode())])
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    if producer.flush(60):
        raise AssertionError(f"not every reading reached {topic}")


def read_rows(bootstrap: str, topic: str, codec: AvroCodec | None, partitions: int = 3,
              idle_s: float = 2.0, timeout_s: float = 120.0) -> list:
    """Every record of ``topic`` decoded (raw messages when ``codec`` is None), until nothing new arrived for ``idle_s``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out, last, deadline = [], time.monotonic(), time.monotonic() + timeout_s
    try:
        while time.monotonic() - last < idle_s and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.2):
                if not msg.error():
                    out.append(codec.decode(msg.value()) if codec is not None else msg)
                    last = time.monotonic()
    finally:
        consumer.close()
    return out


def count_records(bootstrap: str, topic: str, partitions: int = 3, timeout_s: float = 30.0) -> int:
    """The number of records in ``topic`` (sum of its end offsets), asking again while leaders move."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                           for p in range(partitions))
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        consumer.close()


def by_window(rows: Iterable[dict], key: str = "device_id") -> dict[tuple[str, int], dict]:
    """Rows keyed by (entity, window_start); a duplicate must be identical (replays are allowed, changes are not)."""
    out: dict[tuple[str, int], dict] = {}
    for row in rows:
        k = (row[key], row["window_start"])
        if k in out and out[k] != row:
            raise AssertionError(f"two different rows for {k}: {out[k]} vs {row}")
        out[k] = row
    return out


def diff_rows(a: dict[tuple[str, int], dict], b: dict[tuple[str, int], dict], rel: float = 1e-9) -> list[str]:
    """Every difference between two engines' rows: missing windows, other bounds or counts, values off by > rel."""
    problems = [f"only in first: {k}" for k in sorted(a.keys() - b.keys())]
    problems += [f"only in second: {k}" for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        for field, x in a[k].items():
            y = b[k].get(field)
            if isinstance(x, float) and isinstance(y, float):
                if not math.isclose(x, y, rel_tol=rel, abs_tol=1e-12):
                    problems.append(f"{k} {field}: {x!r} != {y!r}")
            elif x != y:
                problems.append(f"{k} {field}: {x!r} != {y!r}")
    return problems


def expected_windows(readings: list[dict], fs: FeatureSet = FEATURE_SET) -> tuple[dict[tuple[str, int], dict], int]:
    """The windows a plain numpy reference computes, and how many readings were late.

    A reading is late when its window closed already: the device's newest event time passed
    the window's end plus the allowed lateness. Windows still open at the end are not emitted.
    Tumbling windows only (hop = size).
    """
    if fs.window.hop_ms != fs.window.size_ms:
        raise ValueError("expected_windows is a tumbling-window reference")
    size, lateness = fs.window.size_ms, fs.window.allowed_lateness_ms
    accepted: dict[tuple[str, int], list[dict]] = {}
    watermark: dict[str, int] = {}
    late = 0
    for r in readings:
        device, start = r["device_id"], r["ts"] - r["ts"] % size
        if start + size + lateness <= watermark.get(device, -1):
            late += 1
            continue
        accepted.setdefault((device, start), []).append(r)
        watermark[device] = max(watermark.get(device, -1), r["ts"])
    out = {}
    for (device, start), rs in accepted.items():
        if start + size + lateness > watermark[device]:
            continue
        rs = sorted(rs, key=lambda r: r["ts"])
        values = np.array([[np.nan if r[s] is None else r[s] for s in fs.inputs] for r in rs])
        out[(device, start)] = {"device_id": device, "window_start": start, "window_end": start + size,
                                "count": len(rs), **compute_window(fs, values)}
    return out, late
