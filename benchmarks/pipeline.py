"""The reference topology run end to end for the benchmarks: readings, a namespaced copy, counts, CPU.

``bench_e2e.py`` (catch-up throughput) and ``bench_latency.py`` (open-loop latency) share these:
the readings of a simulated fleet, a copy of the reference topology under a namespace of its own
that reads a given raw topic, what each stage emitted (topic end offsets), and the CPU time of each
process (``/proc`` through psutil) so that the cost of each stage is visible per reading.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from reference_app import TOPOLOGY, Device
from reference_app import FEATURE_SET
from streams.namespace import namespaced
from streams.settings import StackSettings
from streams.testing import partition_of
from streams.stack import components
from streams.topology import Topology, load_topology

#: The stages of the reference chain, in order (drift and canary are not on the reading → action path).
CHAIN = ("ingest", "features", "inference", "rules")
HZ = 10.0
#: A share of the fleet with faults the model and rules act on, so that actions flow.
FAULTY = (("bearing_wear", 0.05), ("overheating", 0.05), ("sensor_dropout", 0.02))


def fleet(devices: int, seed: int = 3) -> list[Device]:
    """``devices`` machines, a few with faults from 20 s in (the simulator's physics)."""
    rng = np.random.default_rng(seed)
    plan: list[str] = []
    for fault, share in FAULTY:
        plan += [fault] * max(1, int(devices * share))
    return [Device.random(f"dev-{i:05d}", rng, plan[i] if i < len(plan) else "none", 20.0)
            for i in range(devices)]


def reading_bytes(device: Device, ts: int, row: np.ndarray) -> bytes:
    """One reading as a device sends it (JSON, null for a dropped value)."""
    values = ", ".join(f'"{s}": {"null" if math.isnan(v) else round(float(v), 4)}'
                       for s, v in zip(("temperature", "vibration", "current", "pressure", "rpm"), row))
    return (f'{{"event_id": "{uuid.uuid4().hex}", "device_id": "{device.device_id}", "ts": {ts}, {values}}}').encode()


@dataclass(frozen=True)
class History:
    """``readings`` readings of ``devices`` at 10 Hz ending at ``end_ms``, as a catch-up run finds them."""

    devices: list[Device]
    readings: int
    end_ms: int

    @property
    def steps(self) -> int:
        return math.ceil(self.readings / len(self.devices))

    def timestamps(self) -> np.ndarray:
        start_ms = self.end_ms - int(self.steps * 1000 / HZ)
        return start_ms + (np.arange(self.steps) * 1000 / HZ).astype(np.int64)

    def records(self, seed: int = 5) -> Iterator[tuple[str, bytes]]:
        """The readings step by step (every device, then the next step), keyed by device."""
        rng = np.random.default_rng(seed)
        t = np.arange(self.steps) / HZ
        samples = [d.sample(t, rng) for d in self.devices]
        sent = 0
        for k, ts in enumerate(self.timestamps().tolist()):
            for d, rows in zip(self.devices, samples):
                if sent == self.readings:
                    return
                yield d.device_id, reading_bytes(d, ts, rows[k])
                sent += 1

    def windows(self, partitions: int = 3) -> int:
        """Windows the feature stage closes: each window of a device's readings whose end plus the allowed
        lateness its partition's stream time reaches (the newest event time of any device keyed to the same
        partition of the ``partitions`` the features' input has; windows aligned to the epoch)."""
        w = FEATURE_SET.window
        ts = self.timestamps()
        full, extra = divmod(self.readings, len(self.devices))
        counts = [full + 1 if i < extra else full for i in range(len(self.devices))]  # step by step: the first go on
        where = [partition_of(d.device_id, partitions) for d in self.devices]
        stream_time = {p: max(int(ts[c - 1]) for c, q in zip(counts, where) if q == p and c) for p in set(where)
                       if any(c for c, q in zip(counts, where) if q == p)}
        total = 0
        for count, p in zip(counts, where):
            if not count:
                continue
            mine = ts[:count]
            base = mine - mine % w.hop_ms
            starts = np.unique(np.concatenate([base - k * w.hop_ms for k in range(w.size_ms // w.hop_ms)]))
            starts = starts[(starts + w.size_ms > mine[0]) & (starts <= mine[-1])]  # windows holding a reading
            total += int(np.count_nonzero(starts + w.size_ms + w.allowed_lateness_ms <= stream_time[p]))
        return total


def produce(stack: StackSettings, topic: str, records: Iterator[tuple[str, bytes]]) -> int:
    """Produce ``records`` keyed by device and wait for every ack; returns how many."""
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "acks": "all",
                         "linger.ms": 20, "compression.type": "lz4", "queue.buffering.max.messages": 1_000_000})
    n = 0
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.05)
        n += 1
    if producer.flush(120):
        raise RuntimeError(f"{topic}: the benchmark's readings were not all acknowledged")
    return n


def reference_copy(stack: StackSettings, prefix: str, raw_topic: str, replicas: int, overrides: dict | None = None) -> Path:
    """The reference topology under ``prefix``, its ingest reading ``raw_topic``, ``replicas`` per stage."""
    base = load_topology(TOPOLOGY)
    raw_spec = base.topics[base.processors["ingest"].inputs[0]].model_dump(mode="json", by_alias=True,
                                                                            exclude_defaults=True)
    changes = {f"processors/{name}/replicas": replicas for name in CHAIN}
    changes.update({"processors/ingest/inputs": [raw_topic], f"topics/{raw_topic}": raw_spec, "sla/source": raw_topic,
                    **(overrides or {})})
    return namespaced(TOPOLOGY, prefix, stack.home / "bench" / f"{prefix}.yaml", changes)


class Counts:
    """Records on topics (sum of end offsets; no transactions on these topics, so one offset is one record)."""

    def __init__(self, stack: StackSettings):
        self.bootstrap = stack.bootstrap_servers
        self.consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"probe-{uuid.uuid4().hex}",
                                  "enable.auto.commit": False})

    def __call__(self, topic: str, partitions: int = 3) -> int:
        for _ in range(50):
            try:
                return sum(self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                           for p in range(partitions))
            except KafkaException:  # a leader moving: ask again
                time.sleep(0.2)
        raise RuntimeError(f"{topic}: no end offsets")

    def committed(self, group: str, topics: list[str], partitions: int = 3) -> int:
        """Offsets ``group`` has committed on ``topics``, summed (0 for a partition without a commit)."""
        probe = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group,
                          "enable.auto.commit": False})
        try:
            tps = [TopicPartition(t, p) for t in topics for p in range(partitions)]
            return sum(max(tp.offset, 0) for tp in probe.committed(tps, timeout=10))
        finally:
            probe.close()

    def close(self) -> None:
        self.consumer.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (Triton's backend stubs), 0 if it is gone."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def stack_pids(stack: StackSettings) -> dict[str, int]:
    """The running stack's servers by name (kafka, registry, redis, triton)."""
    return {p.name: pid for p in components.build(stack) if (pid := p.pid()) is not None}


@dataclass
class CpuMeter:
    """CPU seconds of named processes between ``start`` and ``stop``."""

    pids: dict[str, list[int]]

    def start(self) -> None:
        self._before = {name: sum(cpu_seconds(p) for p in pids) for name, pids in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(p) for p in pids) - self._before[name] for name, pids in self.pids.items()}


def topics_of(topology: Topology) -> dict[str, str]:
    """The chain's topics by role."""
    spec = topology.processors
    return {"raw": spec["ingest"].inputs[0], "ingested": spec["ingest"].outputs[0], "ingest_dlq": spec["ingest"].dlq,
            "windows": spec["features"].outputs[0], "features_dlq": spec["features"].dlq,
            "predictions": spec["inference"].outputs[0], "inference_dlq": spec["inference"].dlq,
            **{f"action:{t.rsplit('.', 1)[1]}": t for t in spec["rules"].outputs}, "rules_dlq": spec["rules"].dlq}


def dump(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
