"""The feature set as a Faust app (faust-streaming): an embedded engine with changelog-backed state.

One agent reads the source topic (Confluent-framed Avro, keyed by entity); the event-time state
of each partition (``streams.features.compute.PartitionWindows``: open windows of its entities,
its stream time, what is closed) lives in a Faust ``Table`` whose changelog topic
(``<group>-entity_windows-changelog``) restores it when a worker restarts: one key per partition for
its clock (``partition:<p>``: stream time, closed-through, the last offset applied) and one per entity
with open windows (``open:<p>:<entity>``: its windows and the offset of its last reading added). A
reading writes its entity's key, the keys of the entities whose windows it closed, then the
partition's clock, so the changelog carries what changed, not the partition's whole state. The worker
holds each partition's state in memory between readings and rebuilds it from the table after a
rebalance. It has no idle-partition timeout: a quiet partition keeps its last windows open until it
sends again.

Why a plain table and not Faust's ``.tumbling()`` window sets: Faust closes windows on one
stream-time clock for the whole table and expires them by wall time, while the declared
semantics close a window when *its partition's* newest event time passes its end plus the
allowed lateness. Keeping the shared state machine in a changelogged table gives identical
rows to the other engines (``tests/integration/test_parity.py``) and Faust's recovery.

Delivery: a window's output record is acknowledged by the broker before the state that
says "emitted" is written to the table, and the state remembers the offset of the last
reading applied to its partition and of the last added to each entity (a crash between the two keys
leaves the entity's ahead: its reading, read again, moves the clock only), so a reading re-delivered
after a crash is not counted twice. A reading is acknowledged to Faust (so its offset may be committed)
only once the broker has acknowledged the changelog records of the state it changed: Faust's own
``table[key] = value`` leaves them in a buffer that its pre-commit flush drains for at most 0.1 s a
record, so a ``kill -9`` could lose state whose readings were already committed (a window short of a
reading). Every offset is applied in order: the clock's ``applied`` is the last offset the state consumed (an
undecodable reading moves it too), and a reading delivered past ``applied + 1`` has the records in between read
straight from the source partition and applied first. Faust can skip records after a recovery: it resumes the
source partitions and seeks them to the committed offsets, then resumes its flow control, which clears the agents'
queues (faust-streaming 0.15, ``Recovery.on_recovery_completed``); records fetched meanwhile are dropped from the
queue while the consumer counts them as read, so it never delivers them again (faust-streaming issue #596). A
restart whose committed offsets were close to its table's lost exactly those readings (a window a reading short).
The gaps Kafka itself leaves (a transaction's marker, a compacted record) are read as nothing.
Outputs may repeat (same ``event_id``), never go missing. Late readings go to the DLQ topic. The newest row
of each entity goes to the online store, Feast's Redis store (``streams.features.layout``), under
the Feast project ``--project``.

A feature set that declares ``enrichment:`` joins its entity table (``--table``, by default the
feature set's ``enrichment.table``) as the embedded engine does, with the same shared code: the table is
restored whole before the first reading and followed on a thread (``streams.features.table``), and
each reading is judged late first, then joined (``streams.features.enrich.Join``): an unknown entity
is dead-lettered (``unknown_entity``), one failing ``keep`` is filtered, a null input in ``fill`` takes
the table's value; either way the reading moves its partition's stream time. A closed window's row gets
the attributes in effect at its last instant, after its aggregates.

    python -m streams.features.faust_job --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081 \\
        --redis redis://127.0.0.1:6379/0 --source pm.ingest.telemetry --output pm.features.device_window \\
        --dlq pm.dlq.features --group pm.features-faust --project pm
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import faust
import numpy as np
from faust.types.tuples import TP, ConsumerMessage

from confluent_kafka import Consumer, KafkaException, TopicPartition

from streams.avro import codec
from streams.security.kafka import KafkaConnection
from streams.settings import StackSettings
from streams.wire import WireFormatError
from streams.features.compute import OpenWindow, PartitionWindows, output_row
from streams.features.enrich import Join
from streams.features.layout import FeastLayout
from streams.features.online import OnlineWriter
from streams.features.spec import FeatureSet, load_feature_set
from streams.features.table import TableFollower, VersionedTable

log = logging.getLogger("tangram.features.faust")

CARRIED = ("event_id", "trace_id", "ingest_ms")
STAGE = "features-faust"  # its dead letters' stage, its filter counts' processor


def _window_json(w: OpenWindow) -> dict:
    return {"start": w.start, "ts": w.ts, "rows": w.rows,
            "last": {k: base64.b64encode(v).decode() for k, v in (w.last or {}).items() if v is not None}}


def encode_meta(state: PartitionWindows, applied: int) -> bytes:
    """A partition's clock as JSON for the changelog: its stream time, what is closed, the last offset applied."""
    return json.dumps({"stream_time": state.stream_time, "closed_through": state.closed_through, "applied": applied},
                      separators=(",", ":")).encode()


def decode_meta(data: bytes, state: PartitionWindows) -> int:
    """Restore ``state``'s clock from :func:`encode_meta`'s bytes; returns the offset of the last reading applied.

    ``ValueError`` (including a JSON error), ``KeyError`` or ``TypeError`` for bytes that are not such a state.
    """
    saved = json.loads(data)
    state.stream_time, state.closed_through = int(saved["stream_time"]), int(saved["closed_through"])
    return int(saved["applied"])


def encode_windows(windows: list[OpenWindow], applied: int) -> bytes:
    """One entity's open windows as JSON for the changelog, with the offset of its last reading added.

    Plain data, so reading it back runs no code (it was a pickle: bytes from a topic that anyone able to
    write the changelog could turn into code run here). Header values are bytes, so they travel
    base64-encoded; NaN (a missing reading) is JSON's ``NaN`` extension, which Python's json reads back.
    """
    return json.dumps({"applied": applied, "open": [_window_json(w) for w in windows]}, separators=(",", ":")).encode()


def decode_windows(data: bytes) -> tuple[int, list[OpenWindow]]:
    """:func:`encode_windows`'s bytes back: (the offset of the entity's last reading added, its open windows)."""
    saved = json.loads(data)
    windows = []
    for w in saved["open"]:
        window = OpenWindow(int(w["start"]), None, [int(t) for t in w["ts"]], [[float(x) for x in r] for r in w["rows"]])
        window.last = {str(k): base64.b64decode(v, validate=True) for k, v in w["last"].items()} or None
        windows.append(window)
    return int(saved["applied"]), windows


def meta_key(partition: int) -> bytes:
    return b"partition:%d" % partition


def open_key(partition: int, entity: str) -> bytes:
    return b"open:%d:" % partition + entity.encode()


@dataclass(frozen=True)
class SourceRecord:
    """A record of the source topic as the agent applies it: one Faust delivered, or one read to fill a gap."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    @classmethod
    def of(cls, message: faust.types.tuples.Message) -> "SourceRecord":
        return cls(message.topic, message.partition, message.offset, message.key, message.value,
                   tuple(message.headers or ()))


def missed(applied: int, offset: int) -> tuple[int, int] | None:
    """The offsets ``[start, end)`` between the last one a partition's state applied and the one delivered now,
    when there are any: what was not delivered (or what Kafka leaves empty: a transaction marker, a compacted
    record). ``applied`` -1: the state has applied nothing of the partition, so from its beginning."""
    start = applied + 1
    return (start, offset) if offset > start else None


class PartitionReader:
    """Reads a topic's partition straight from the broker between two offsets, as Faust's consumer would deliver it
    (uncommitted reads, from the earliest offset when ``start`` is gone): the records a delivery skipped."""

    def __init__(self, config: dict, topic: str, timeout_s: float = 60.0):
        self.config, self.topic, self.timeout_s = config, topic, timeout_s
        self._consumer: Consumer | None = None

    def between(self, partition: int, start: int, end: int) -> list[SourceRecord]:
        """The records at offsets ``start`` (included) to ``end`` (excluded; a record there or after must exist)."""
        if self._consumer is None:
            self._consumer = Consumer(self.config)
        self._consumer.assign([TopicPartition(self.topic, partition, start)])
        out: list[SourceRecord] = []
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                msg = self._consumer.poll(0.5)
                if msg is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.topic}[{partition}]: no record at {start} or after in "
                                           f"{self.timeout_s} s, while one at {end} was delivered")
                    continue
                if msg.error():
                    raise KafkaException(msg.error())
                if msg.offset() >= end:
                    return out
                out.append(SourceRecord(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                                        tuple(msg.headers() or ())))
        finally:
            self._consumer.unassign()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


class Undelivered:
    """The acknowledgement to Faust of a record it did not deliver (read by :class:`PartitionReader`), as an
    event's: its offset counts as processed, so the offsets after it can commit."""

    def __init__(self, app: faust.App, record: SourceRecord):
        self.app = app
        self.message = ConsumerMessage(record.topic, record.partition, record.offset, 0.0, 0, list(record.headers),
                                       record.key, record.value, None, tp=TP(record.topic, record.partition),
                                       generation_id=app.consumer_generation_id)

    def ack(self) -> bool:
        return self.message.ack(self.app.consumer)


def ack_when_durable(event: faust.types.EventT, sent: list[asyncio.Future]) -> None:
    """Acknowledge ``event`` once every changelog record of its state is acknowledged by the broker (a send
    that fails leaves it unacknowledged: its offset is never committed and a restart reads it again)."""
    if not sent:
        event.ack()
        return
    done = asyncio.gather(*sent)
    done.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or event.ack())


def broker_credentials() -> faust.SASLCredentials | None:
    """Faust's credentials from this process's Kafka security (``TANGRAM_KAFKA_SECURITY``), as every client's."""
    auth = StackSettings().kafka.security.aiokafka()
    if auth["security_protocol"] == "PLAINTEXT":
        return None
    return faust.SASLCredentials(username=auth["sasl_plain_username"], password=auth["sasl_plain_password"],
                                 mechanism=auth["sasl_mechanism"], ssl_context=auth["ssl_context"])


def entity_table(fs: FeatureSet, args: argparse.Namespace) -> tuple[Join, TableFollower]:
    """The join over the feature set's entity table (``--table``, default its ``enrichment.table``), and the
    table's follower (not yet restored)."""
    assert fs.enrichment is not None
    topic = args.table or fs.enrichment.table
    table_codec = codec(args.registry, fs.enrichment.schema_)  # the contract as `tangram apply` registered it
    fields = {f["name"] for f in table_codec.schema_json["fields"]}
    if lacking := [a for a in fs.enrichment.used if a not in fields]:
        raise SystemExit(f"feature set {fs.name}: table {topic!r} has no attribute(s) {lacking}")
    table = VersionedTable(fs.enrichment.used)
    kafka = KafkaConnection(args.bootstrap, StackSettings().kafka.security).config({"group.id": f"{args.group}-table"})
    return Join(fs, table, STAGE), TableFollower(kafka, topic, table_codec.decode, table)


def build_app(args: argparse.Namespace) -> faust.App:
    """The Faust app of one feature set: source agent, state table, output and DLQ topics, and the entity
    table it joins (restored here, before any reading; followed until the app stops)."""
    fs = load_feature_set(args.feature_set)
    in_codec = codec(args.registry, fs.source.schema_)  # the contracts as `tangram apply` registered them
    out_codec = codec(args.registry, fs.output.schema_)
    store = OnlineWriter(args.redis, FeastLayout.of(fs, args.project))
    # Faust's own files (its table metadata) under the stack's home, not in whatever folder the job starts in
    datadir = Path(args.datadir) if args.datadir else StackSettings().home / "faust" / f"{args.group}-data"
    datadir.parent.mkdir(parents=True, exist_ok=True)  # Faust makes the folder itself, not its parents
    app = faust.App(
        args.group, broker=f"kafka://{args.bootstrap}", store="memory://", web_enabled=False,
        topic_partitions=args.partitions, topic_replication_factor=1, consumer_auto_offset_reset="earliest",
        table_standby_replicas=0, stream_wait_empty=False, key_serializer="raw", value_serializer="raw",
        broker_credentials=broker_credentials(),
        datadir=str(datadir),
    )
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    source = app.topic(args.source, internal=False, **raw)
    output = app.topic(args.output, internal=False, **raw)
    dlq = app.topic(args.dlq, internal=False, **raw)
    table = app.Table("entity_windows", default=None, partitions=args.partitions, key_type=bytes, value_type=bytes)

    async def dead_letter(record: SourceRecord, reason: str, message: str) -> None:
        headers = {**dict(record.headers),
                   "dlq.stage": STAGE.encode(), "dlq.reason": reason.encode(), "dlq.error_class": b"Rejected",
                   "dlq.error_message": message[:1000].encode(), "dlq.source_topic": record.topic.encode(),
                   "dlq.source_partition": str(record.partition).encode(),
                   "dlq.source_offset": str(record.offset).encode(),
                   "dlq.failed_ms": str(int(time.time() * 1000)).encode()}
        await (await dlq.send(key=record.key, value=record.value, headers=headers))

    join, follower = entity_table(fs, args) if fs.enrichment is not None else (None, None)
    if follower is not None:
        follower.restore()  # the whole table before the first reading joins it
        follower.start()

        @app.on_before_shutdown.connect
        async def _stopping(sender, **kwargs) -> None:
            follower.close()

    async def enrich(record: SourceRecord, entity: str, ts: int, values: np.ndarray) -> bool:
        """Join a reading that is not late (``values``, one row, filled in place): whether it stays in the stream.
        A reading of an unknown entity is dead-lettered, one failing ``keep`` counted."""
        assert join is not None and follower is not None
        verdicts = join.readings([entity], np.array([ts], dtype=np.int64), values)
        join.count(verdicts, np.zeros(1, dtype=bool))
        if verdicts.unknown[0]:
            await dead_letter(record, "unknown_entity",
                              f"{fs.entity.join_key} {entity} has no version in table {follower.topic} at {ts}")
        return bool(verdicts.keep[0])

    #: Each partition's state as this worker holds it between readings: (windows, last offset applied, last
    #: offset added per entity). Rebuilt from the table after every rebalance (the table is what restores).
    held: dict[int, tuple[PartitionWindows, int, dict[str, int]]] = {}

    @app.on_partitions_revoked.connect
    async def _revoked(sender, revoked, **kwargs) -> None:  # noqa: ARG001 - the signal's arguments
        held.clear()

    @app.on_partitions_assigned.connect
    async def _assigned(sender, assigned, **kwargs) -> None:  # noqa: ARG001
        held.clear()

    def restore(partition: int) -> tuple[PartitionWindows, int, dict[str, int]]:
        """A partition's state from the table: its clock, and each of its entities' open windows."""
        state, applied, added = PartitionWindows(fs), -1, {}
        saved = table.get(meta_key(partition))
        if saved is not None:
            applied = decode_meta(saved, state)
        prefix = open_key(partition, "")
        for key, value in list(table.items()):
            if value is not None and key.startswith(prefix):
                entity = key[len(prefix):].decode("utf-8")
                added[entity], windows = decode_windows(value)
                for window in windows:
                    state.open[(entity, window.start)] = window
        return state, applied, added

    def put(partition: int, key: bytes, value: bytes | None) -> asyncio.Future:
        """Set (``None``: delete) a key of the table and send its changelog record; what the broker's ack resolves."""
        if value is None:
            table.data.pop(key, None)
            return table.send_changelog(partition, key, None, value_serializer="raw")
        table.data[key] = value
        return table.send_changelog(partition, key, value)

    #: Reads what Faust did not deliver between a partition's last applied offset and the one it delivers.
    reader = PartitionReader(KafkaConnection(args.bootstrap, StackSettings().kafka.security).config(
        {"group.id": f"{args.group}-gaps", "enable.auto.commit": False, "auto.offset.reset": "earliest",
         "isolation.level": "read_uncommitted"}), args.source)

    @app.on_before_shutdown.connect
    async def _close_reader(sender, **kwargs) -> None:  # noqa: ARG001
        reader.close()

    async def apply(record: SourceRecord) -> list[asyncio.Future]:
        """Apply one record of the source to its partition's state: the changelog records it sent (none for a
        record the state already holds: re-delivered after a restart), which acknowledge it once the broker has."""
        if record.partition not in held:
            held[record.partition] = restore(record.partition)
        state, applied, added = held[record.partition]
        if record.offset <= applied:
            return []  # re-delivered after a restart: already in the state
        partition, offset = record.partition, record.offset
        entity = record.key.decode("utf-8") if record.key is not None else ""
        try:
            reading = in_codec.decode(record.value)
        except WireFormatError as exc:
            await dead_letter(record, "undecodable", str(exc))
            held[partition] = (state, offset, added)  # the clock moves past it: applied is every offset consumed
            return [put(partition, meta_key(partition), encode_meta(state, offset))]
        ts = reading[fs.source.timestamp_field]
        late = False
        if offset <= added.get(entity, -1):
            # the entity's windows hold it (a crash came between its key and the partition's): only the clock moves
            joined, closed = True, state.advance(ts)
        else:
            # lateness first, whatever the entity; a reading that joins no window still moves the clock
            values = np.array([[math.nan if reading[s] is None else reading[s] for s in fs.inputs]], dtype=np.float64)
            late = state.late(ts)
            joined = not late and (join is None or await enrich(record, entity, ts, values))
            if joined:
                carried = {k: v for k, v in dict(record.headers).items() if k in CARRIED}
                _, closed = state.add(entity, ts, values[0].tolist(), None, carried)
                added[entity] = offset
            else:
                closed = state.advance(ts)
        if late:
            await dead_letter(record, "late", f"reading at {ts} is late: its windows are already closed")
        attributes = (join.attributes([(w["entity"], w["start"]) for w in closed]) if join is not None
                      else np.empty((len(closed), 0)))
        for window, attributes_of_window in zip(closed, attributes):
            out = output_row(fs, window["entity"], window, attributes_of_window)
            headers = {**(window["window"].last or {}), "event_id": f"{window['entity']}:{window['start']}".encode()}
            await (await output.send(key=window["entity"].encode(), value=out_codec.encode(out), headers=headers))
            store.stage(out)
        if closed:
            store.flush()
        # only what changed goes to the changelog: the entities whose windows changed, then the partition's clock
        sent = []
        for name in ({entity} if joined else set()) | {w["entity"] for w in closed}:
            mine = [w for (e, _), w in state.open.items() if e == name]
            if mine:
                sent.append(put(partition, open_key(partition, name), encode_windows(mine, added.get(name, -1))))
            elif open_key(partition, name) in table.data:
                added.pop(name, None)
                sent.append(put(partition, open_key(partition, name), None))
            else:
                added.pop(name, None)
        held[partition] = (state, offset, added)
        sent.append(put(partition, meta_key(partition), encode_meta(state, offset)))
        return sent

    async def fill(partition: int, start: int, end: int) -> None:
        """Apply the records at offsets ``start`` to ``end`` (excluded) of a partition, read from the broker:
        the ones Faust did not deliver (none where Kafka leaves the offsets empty). Each is acknowledged to Faust
        as a delivered one is, so its offsets commit in order."""
        records = await asyncio.get_running_loop().run_in_executor(None, reader.between, partition, start, end)
        if records:
            log.warning("%s[%d]: offsets %d to %d were not delivered (%d records): read from the partition, applied "
                        "before offset %d", args.source, partition, start, end - 1, len(records), end)
        for record in records:
            ack_when_durable(Undelivered(app, record), await apply(record))

    @app.agent(source)
    async def windows(stream: faust.StreamT) -> None:
        async for event in stream.noack().events():  # acknowledged by ack_when_durable, never before
            record = SourceRecord.of(event.message)
            if record.partition not in held:
                held[record.partition] = restore(record.partition)
            if (gap := missed(held[record.partition][1], record.offset)) is not None:
                await fill(record.partition, *gap)
            ack_when_durable(event, await apply(record))

    return app


def command(python: str, *, bootstrap: str, registry: str, redis_url: str, project: str, source: str, output: str,
            dlq: str, group: str, feature_set: str, table: str | None = None) -> list[str]:
    """The command line of a worker of this app (``table``: the entity table's topic, when not the feature set's)."""
    return [python, "-m", "streams.features.faust_job", "--bootstrap", bootstrap, "--registry", registry,
            "--redis", redis_url, "--project", project, "--source", source, "--output", output, "--dlq", dlq,
            "--group", group, "--feature-set", feature_set, *(["--table", table] if table else [])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streams.features.faust_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--redis", required=True, help="Online store URL.")
    p.add_argument("--project", required=True,
                   help="Feast project of the online store (Feast's Redis layout), e.g. the topology's app.")
    p.add_argument("--feature-set", required=True, help="The feature-set declaration (YAML).")
    p.add_argument("--source", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--dlq", required=True)
    p.add_argument("--group", required=True, help="Faust app id: consumer group and changelog topic prefix.")
    p.add_argument("--table", help="The entity table's topic (default: the feature set's `enrichment.table`).")
    p.add_argument("--partitions", type=int, default=3, help="Partitions of the source topic (the table's).")
    p.add_argument("--datadir", help="Faust's data folder (default: <TANGRAM_HOME>/faust/<group>-data).")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    app = build_app(args)
    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()


if __name__ == "__main__":
    main()
