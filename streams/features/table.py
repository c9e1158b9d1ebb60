"""An entity table: a compacted topic keyed by entity, read whole into local, versioned state.

Kafka Streams' global table, with the versions of its versioned stores; Flink's versioned table of an
event-time temporal join. Every replica of the joining processor holds all of it (the table is small
beside the stream: 100k entities are tens of MB, ``make bench``). A record's Kafka timestamp is when its
version takes effect; a tombstone (a null value) ends the entity from its timestamp on. Lookups are by
event time, so a replay joins the versions the live run joined, whatever the order the two topics were
read in — except a version that reaches the table after the windows it would have changed were emitted:
those stay as emitted (the table is followed live, within a poll of its writes).

On start, :class:`TableFollower` reads the topic from its beginning up to the high watermarks it finds
(the restore), then follows it on a thread of its own until closed. A value that does not decode is
counted and logged with its offset, and the entity keeps its previous version: a bad write to the table
never stops the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from sys import intern
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from prometheus_client import Counter, Gauge

from streams.errors import StackError
from streams.wire import WireFormatError

log = logging.getLogger("tangram.features.table")

#: Broker answers that pass once a topic just created has its leaders (retried while restoring).
RETRIED = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                     KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TIMED_OUT})

TABLE_UPDATES = Counter("tangram_table_updates_total", "Table records applied (versions and tombstones).",
                        ["table", "kind"])
TABLE_ERRORS = Counter("tangram_table_undecodable_total", "Table records whose value did not decode (skipped).",
                       ["table"])
TABLE_ENTITIES = Gauge("tangram_table_entities", "Entities with a version in the local table.", ["table"])

#: The versions kept per entity: older ones are dropped (a reading older than all of them finds the oldest).
KEEP_VERSIONS = 4


class VersionedTable:
    """entity → its versions (effective time, the used attributes as a tuple, or None for a tombstone)."""

    def __init__(self, fields: tuple[str, ...], keep_versions: int = KEEP_VERSIONS):
        self.fields = fields
        self.keep = keep_versions
        self._versions: dict[str, tuple[tuple[int, ...], tuple[tuple | None, ...]]] = {}
        self._live = 0  # entities whose newest version is not a tombstone (kept as versions are put, not counted)

    def put(self, entity: str, effective_ms: int, record: dict[str, Any] | None) -> None:
        """A version of ``entity`` from ``effective_ms`` on (``record`` None: a tombstone)."""
        # the attribute values interned (a fleet repeats its sites and statuses: one string each, not one per entity)
        value = None if record is None else tuple(intern(v) if isinstance(v, str) else v
                                                  for v in (record.get(f) for f in self.fields))
        old_times, old_values = self._versions.get(entity, ((), ()))
        was_live = bool(old_values) and old_values[-1] is not None
        times, values = list(old_times), list(old_values)
        i = bisect_right(times, effective_ms)
        if i and times[i - 1] == effective_ms:
            values[i - 1] = value  # the same instant written again: the newer write wins
        else:
            times.insert(i, effective_ms)
            values.insert(i, value)
        # new tuples swapped in at once (the engine reads on another thread than the follower writes), and
        # smaller than lists: most entities have one version
        self._versions[intern(entity)] = (tuple(times[-self.keep:]), tuple(values[-self.keep:]))
        self._live += (values[-1] is not None) - was_live

    def at(self, entity: str, ts: int) -> tuple | None:
        """The attributes of ``entity`` in effect at event time ``ts``; None when it has none then."""
        versions = self._versions.get(entity)
        if versions is None:
            return None
        times, values = versions
        if ts >= times[-1]:
            return values[-1]
        i = bisect_right(times, ts)
        return values[i - 1] if i else None

    def __len__(self) -> int:
        return self._live


class TableFollower:
    """Restores ``table`` from ``topic``, then keeps it current on a daemon thread until :meth:`close`."""

    def __init__(self, kafka_config: dict[str, Any], topic: str, decode: Callable[[bytes], dict[str, Any]],
                 table: VersionedTable, restore_timeout_s: float = 120.0):
        self.topic = topic
        self.decode = decode
        self.table = table
        self.restore_timeout_s = restore_timeout_s
        # a small fetch queue: the table is read once whole, then a trickle of updates
        self.consumer = Consumer({**kafka_config, "enable.auto.commit": False, "auto.offset.reset": "earliest",
                                  "enable.partition.eof": False, "queued.max.messages.kbytes": 4096,
                                  "fetch.max.bytes": 4 * 1024 * 1024})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def restore(self) -> int:
        """Read the topic from its beginning to the high watermarks of now; the records applied."""
        metadata = self.consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise StackError(f"table topic {self.topic!r} does not exist: `tangram apply` creates it")
        partitions = [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in metadata.partitions]
        deadline = time.monotonic() + self.restore_timeout_s
        ends = {p.partition: self._end(p, deadline) for p in partitions}
        self.consumer.assign(partitions)
        pending = {p for p, end in ends.items() if end > 0}
        applied = 0
        while pending:
            if time.monotonic() > deadline:
                raise StackError(f"table {self.topic!r}: not restored within {self.restore_timeout_s:g}s "
                                 f"(partitions {sorted(pending)} short of their end)")
            for msg in self.consumer.consume(1000, 0.5):
                if self._apply(msg):
                    applied += 1
                if msg.error() is None and msg.offset() + 1 >= ends[msg.partition()]:
                    pending.discard(msg.partition())
        TABLE_ENTITIES.labels(self.topic).set(len(self.table))
        log.info("table %s restored: %d records, %d entities", self.topic, applied, len(self.table))
        return applied

    def _end(self, partition: TopicPartition, deadline: float) -> int:
        """The partition's high watermark; asked again while the broker's answer is retriable (a topic just
        created has no leader yet: NOT_LEADER_FOR_PARTITION, LEADER_NOT_AVAILABLE)."""
        while True:
            try:
                return self.consumer.get_watermark_offsets(partition, timeout=10)[1]
            except KafkaException as exc:
                if not exc.args[0].retriable() and exc.args[0].code() not in RETRIED or time.monotonic() > deadline:
                    raise StackError(f"table {self.topic!r}: the end of partition {partition.partition} is not "
                                     f"known: {exc.args[0].str()}") from exc
                time.sleep(0.2)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name=f"table-{self.topic}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            msgs = self.consumer.consume(500, 0.2)
            for msg in msgs:
                self._apply(msg)
            if msgs:
                TABLE_ENTITIES.labels(self.topic).set(len(self.table))

    def _apply(self, msg) -> bool:
        if msg.error() is not None:
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("table %s: %s", self.topic, msg.error())
            return False
        key = msg.key()
        if key is None:
            TABLE_ERRORS.labels(self.topic).inc()
            log.warning("table %s: a record without a key at %d@%d skipped", self.topic, msg.partition(), msg.offset())
            return False
        entity, effective = key.decode("utf-8", "replace"), msg.timestamp()[1]
        if msg.value() is None:
            self.table.put(entity, effective, None)
            TABLE_UPDATES.labels(self.topic, "tombstone").inc()
            return True
        try:
            record = self.decode(msg.value())
        except WireFormatError as exc:
            TABLE_ERRORS.labels(self.topic).inc()
            log.warning("table %s: %s at %d@%d skipped (%s keeps its version)", self.topic, exc, msg.partition(),
                        msg.offset(), entity)
            return False
        self.table.put(entity, effective, record)
        TABLE_UPDATES.labels(self.topic, "version").inc()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.consumer.close()
