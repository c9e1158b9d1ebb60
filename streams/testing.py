"""Testing an app against the local stack: a harness, and the helpers tests and benchmarks share.

:class:`AppHarness` is to a Tangram app what Kafka Streams' ``TopologyTestDriver`` is to a
topology: it runs the app's processors (all, or those named) on the local stack under a namespace
of their own (fresh topics and consumer groups), takes records for any of its topics and returns
what came out of any other, decoded::

    with AppHarness("topologies/my_app", stack, processors=["ingest", "score"]) as app:
        app.send("my.raw.events", [{"event_id": "e1", "entity": "a", "ts": now, "value": 3.0}], key="entity")
        [scored] = app.read("my.scored.events", count=1)

``produce_records`` writes records to a topic keyed by a field, ``read_rows`` reads a topic back,
``by_window`` / ``diff_rows`` / ``expected_windows`` compare feature windows between engines and
with a plain numpy reference of a feature set.
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from streams.avro import AvroCodec, topic_codec
from streams.features.compute import compute_window
from streams.features.spec import FeatureSet
from streams.launcher import Processors
from streams.namespace import namespaced
from streams.plan import apply
from streams.security.kafka import KafkaConnection
from streams.settings import StackSettings
from streams.topology import Topology, load_topology, topology_file


def create_topics(kafka: KafkaConnection, topics: Iterable[str], partitions: int = 3) -> None:
    admin = AdminClient(kafka.config())
    futures = admin.create_topics([NewTopic(t, partitions, 1) for t in topics])
    for future in futures.values():
        future.result(30)


def partition_of(key: str, partitions: int) -> int:
    """The partition of a key: CRC-32 of its bytes modulo the partition count (librdkafka's default partitioner,
    ``consistent_random``, for a key that is not empty); what ``produce_records(..., partitions=n)`` uses."""
    return zlib.crc32(key.encode()) % partitions


def produce_records(kafka: KafkaConnection, topic: str, codec: AvroCodec | None, records: list[dict], key: str,
                    id_field: str = "event_id", partitions: int | None = None) -> None:
    """Produce ``records`` (Avro with ``codec``, else JSON) keyed by their ``key`` field, in order, with their
    ``event_id`` and ``trace_id`` headers, and wait for every ack. With ``partitions``, each goes to
    ``partition_of(key, partitions)`` explicitly, the partition a reference computation assumes."""
    producer = Producer(kafka.config({"enable.idempotence": True, "linger.ms": 20,
                                      "compression.type": "lz4"}))
    for r in records:
        value = codec.encode(r) if codec is not None else orjson.dumps(r)
        event = str(r[id_field]).encode()
        where = {} if partitions is None else {"partition": partition_of(str(r[key]), partitions)}
        while True:
            try:
                producer.produce(topic, value, str(r[key]), headers=[("event_id", event), ("trace_id", event)], **where)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    if producer.flush(60):
        raise AssertionError(f"not every record reached {topic}")


def read_rows(kafka: KafkaConnection, topic: str, codec: AvroCodec | None, partitions: int = 3,
              idle_s: float = 2.0, timeout_s: float = 120.0, count: int | None = None) -> list:
    """Every record of ``topic`` decoded (raw messages when ``codec`` is None), until ``count`` arrived or
    nothing new arrived for ``idle_s``."""
    consumer = Consumer(kafka.config({"group.id": f"reader-{uuid.uuid4().hex}",
                                      "enable.auto.commit": False, "isolation.level": "read_committed"}))
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: list = []
    last, deadline = time.monotonic(), time.monotonic() + timeout_s
    try:
        while (count is None or len(out) < count) and time.monotonic() - last < idle_s \
                and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.2):
                if not msg.error():
                    out.append(codec.decode(msg.value()) if codec is not None else msg)
                    last = time.monotonic()
    finally:
        consumer.close()
    return out


def count_records(kafka: KafkaConnection, topic: str, partitions: int = 3, timeout_s: float = 30.0) -> int:
    """The number of records in ``topic`` (sum of its end offsets), asking again while leaders move."""
    consumer = Consumer(kafka.config({"group.id": "probe"}))
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


def by_window(rows: Iterable[dict], key: str) -> dict[tuple[str, int], dict]:
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
                if not math.isclose(x, y, rel_tol=rel, abs_tol=1e-12) and not (math.isnan(x) and math.isnan(y)):
                    problems.append(f"{k} {field}: {x!r} != {y!r}")
            elif x != y:
                problems.append(f"{k} {field}: {x!r} != {y!r}")
    return problems


def expected_windows(readings: list[dict], fs: FeatureSet, partitions: int,
                     quiet: bool = False) -> tuple[dict[tuple[str, int], dict], int]:
    """The windows a plain numpy reference computes for feature set ``fs``, and how many readings were late.

    The readings are in arrival order, each in partition ``partition_of(entity, partitions)``. A partition's
    stream time is the newest event time read from it; a window closes when that reaches its end plus the
    allowed lateness, and a reading is late when its window closed already. Windows still open at the end
    are emitted only when ``quiet`` (the partitions went quiet: the idle timeout closed them).
    Tumbling windows only (hop = size).
    """
    if fs.window.hop_ms != fs.window.size_ms:
        raise ValueError("expected_windows is a tumbling-window reference")
    size, lateness = fs.window.size_ms, fs.window.allowed_lateness_ms
    key, ts = fs.entity.join_key, fs.source.timestamp_field
    accepted: dict[tuple[str, int], list[dict]] = {}
    stream_time: dict[int, int] = {}
    late = 0
    for r in readings:
        entity, start = r[key], r[ts] - r[ts] % size
        partition = partition_of(entity, partitions)
        stream_time[partition] = max(stream_time.get(partition, -1), r[ts])
        if start + size + lateness <= stream_time[partition]:
            late += 1
            continue
        accepted.setdefault((entity, start), []).append(r)
    out = {}
    for (entity, start), rs in accepted.items():
        if start + size + lateness > stream_time[partition_of(entity, partitions)] and not quiet:
            continue
        rs = sorted(rs, key=lambda r: r[ts])
        values = np.array([[np.nan if r[s] is None else r[s] for s in fs.inputs] for r in rs])
        out[(entity, start)] = {key: entity, "window_start": start, "window_end": start + size,
                                "count": len(rs), **compute_window(fs, values)}
    return out, late


class AppHarness:
    """An app's processors on the local stack under a namespace of their own, for a test (see the module's doc).

    Topics are named as the app names them; the harness maps them into its namespace. ``processors``
    limits what runs (default: every processor of the app).
    """

    def __init__(self, app: str | Path, stack: StackSettings, processors: list[str] | None = None,
                 prefix: str | None = None):
        self.source = topology_file(app)
        self.original = load_topology(self.source)
        self.stack = stack
        self.prefix = prefix or f"t{uuid.uuid4().hex[:8]}"
        self.names = processors
        self._folder = tempfile.TemporaryDirectory(prefix="tangram-harness-")
        self.topology: Topology | None = None
        self._processors: Processors | None = None

    def __enter__(self) -> "AppHarness":
        path = namespaced(self.source, self.prefix, Path(self._folder.name) / "topology.yaml")
        self.topology = load_topology(path)
        apply(self.topology, self.stack)
        self._processors = Processors(path, self.stack, self.names)
        self._processors.start()
        self._processors.wait_joined()
        return self

    def __exit__(self, *_: object) -> None:
        if self._processors is not None:
            self._processors.stop()
        self._folder.cleanup()

    def topic(self, name: str) -> str:
        """The harness's copy of the app's topic ``name``."""
        if name not in self.original.topics:
            raise KeyError(f"app {self.original.app!r} has no topic {name!r}")
        return self.prefix + name[len(self.original.app):]

    def _codec(self, topic: str) -> AvroCodec | None:
        assert self.topology is not None, "use the harness as a context manager"
        return topic_codec(self.topology, self.stack.registry_url, topic) \
            if self.topology.topics[topic].format == "avro" else None

    def send(self, topic: str, records: list[dict], key: str, id_field: str = "event_id") -> None:
        """Produce ``records`` to the app's ``topic`` (Avro or JSON, as declared), keyed by their ``key`` field."""
        target = self.topic(topic)
        produce_records(self.stack.kafka, target, self._codec(target), records, key, id_field)

    def read(self, topic: str, count: int | None = None, idle_s: float = 3.0, timeout_s: float = 60.0) -> list[Any]:
        """The records of the app's ``topic`` decoded (raw messages for a JSON or bytes topic): until ``count``
        of them arrived, or nothing new for ``idle_s``."""
        target = self.topic(topic)
        assert self.topology is not None
        return read_rows(self.stack.kafka, target, self._codec(target), self.topology.partitions(target),
                         idle_s=idle_s, timeout_s=timeout_s, count=count)
