"""The embedded feature engine: a ``Processor`` in the one delivery loop (``streams.delivery``).

Event-time windows per entity, as the feature set declares them, closed when the stream time of
their partition (its newest event time, whatever the entity) passes the window end plus the allowed
lateness — Kafka Streams' stream time, a Flink Kafka source's per-partition watermark — so an entity
that goes quiet does not hold its windows, nor its partition's committed offset, open. A partition
that goes quiet has its windows closed after ``idle_partition_s``. Readings for a window already
closed are late: counted and sent to the DLQ, never dropped.

State and offsets: open windows live in memory; the committed offset of a partition never
passes the first offset of a window still open there, so a restarted job rebuilds its
windows by re-reading. How far it got (per partition the offset below which everything was
processed and acknowledged, and the newest window closed there) is written to
Redis with the rows, after the broker acknowledged them (``streams.features.progress``): after a
restart, a reading below that mark either rebuilds a window still open or, its window emitted
before, is a re-read — counted, never dead-lettered as late — and no window is emitted twice
except those of a batch acknowledged but not yet recorded when the process died.

The online store is Feast's Redis store (``streams.features.layout``): the newest row of each
entity under the Feast project named after the topology's ``app`` (so a namespaced copy of the
topology, a replay or a test, writes its own project), ``FeatureStore.get_online_features``
serves it and the rules read it (``online_layout``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import numpy as np
from confluent_kafka import TopicPartition
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, H_INGEST_MS, Output, Processor, Record, carry_headers, dead_letter
from streams.features.batch import BatchWindows, Closed
from streams.features.enrich import Join
from streams.errors import TopologyError
from streams.features.layout import FeastLayout
from streams.features.online import OnlineWriter
from streams.features.progress import REREAD, Progress
from streams.features.shadow import ShadowComparator
from streams.features.shadow import encode as encode_difference
from streams.features.spec import FeatureSet, load_feature_set
from streams.features.table import TableFollower, VersionedTable
from streams.resilience import REDIS_FAILURES, Guard
from streams.topology import Topology

log = logging.getLogger("tangram.features")

LATE = Counter("tangram_features_late_records_total", "Readings that arrived after their window closed.", ["processor"])
IDLE_CLOSED = Counter("tangram_features_idle_closed_windows_total",
                      "Windows closed because their partition went quiet (idle_partition_s), not by event time.",
                      ["processor"])


class WindowFeaturesSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    feature_set: str = Field(description="The feature-set declaration (YAML), relative to the app folder.")
    shadow_feature_set: str | None = Field(None, description="A new version of the feature set, computed beside the live "
                                                             "one and compared with it; never served.")
    shadow_topic: str | None = Field(None, description="Where differing shadow rows are sampled (JSON); an output.")
    shadow_sample_every: int = Field(1, ge=1, description="Send one differing row in N to the shadow topic.")
    idle_partition_s: float = Field(30.0, gt=0, description="A partition that brought no reading for this long has "
                                                             "its open windows closed and emitted (its stream time "
                                                             "moves past them); later readings of them are late.")


def online_layout(topology: Topology, processor: str = "features") -> FeastLayout:
    """Where the features processor ``processor`` of ``topology`` keeps its rows: its feature set, in
    the Feast project named after the topology's app."""
    spec = topology.processors.get(processor)
    if spec is None:
        raise TopologyError(f"app {topology.app!r} has no features processor {processor!r} to read online features of")
    settings = WindowFeaturesSettings.model_validate(spec.params)
    return FeastLayout.of(load_feature_set(topology.path(settings.feature_set)), topology.app)


class WindowFeatures(Processor):
    """Telemetry (Avro) → one output row (Avro) per entity and window, and the Redis online store."""

    name = "features"
    services = frozenset({"redis", "registry"})  # the online store, the codecs
    lazy_headers = True  # the headers of a closing window's newest reading and of the one that closed it

    def __init__(self, *, input_codec: AvroCodec, output_codec: AvroCodec, source_topic: str, output_topic: str,
                 dlq_topic: str,
                 redis_url: str, settings: WindowFeaturesSettings, feature_set: FeatureSet,
                 shadow_feature_set: FeatureSet | None = None, shadow_topic: str | None = None,
                 project: str = "tangram", redis_guard: Guard | None = None,
                 table: tuple[VersionedTable, TableFollower | None] | None = None):
        self.input_codec = input_codec
        self.output_codec = output_codec
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.settings = settings
        self.fs = feature_set
        self.layout = FeastLayout.of(self.fs, project)
        self.store = OnlineWriter(redis_url, self.layout, guard=redis_guard)  # Redis down: backpressure
        self.windows = BatchWindows(self.fs, offset=lambda r: r.offset)
        self.progress = Progress(self.store, source_topic, self.name)
        self._heard: dict[int, float] = {}  # partition → when a batch last brought a reading of it (monotonic)
        self._batch_in = input_codec.batch
        if output_codec.batch is None:
            raise TopologyError(f"the output schema {output_codec.subject!r} is not a flat record of the feature set's "
                                "columns: the engine writes it a batch at a time")
        self._batch_out = output_codec.batch
        self.shadow_topic = shadow_topic
        self.shadow = ShadowComparator(self.fs, shadow_feature_set, self.name) if shadow_feature_set else None
        self._differences = 0
        if (table is None) != (self.fs.enrichment is None):
            raise TopologyError(f"feature set {self.fs.name!r}: an entity table is given iff it declares `enrichment:`")
        self.join = Join(self.fs, table[0], self.name) if table else None
        self.follower = table[1] if table else None

    @classmethod
    def build(cls, ctx: BuildContext) -> WindowFeatures:
        settings = WindowFeaturesSettings.model_validate(ctx.spec.params)
        (source,) = ctx.spec.inputs
        outputs = [t for t in ctx.spec.outputs if t != settings.shadow_topic]
        if settings.shadow_feature_set and settings.shadow_topic not in ctx.spec.outputs:
            raise TopologyError(f"processor {ctx.name!r}: a shadow feature set needs `shadow_topic`, one of its outputs")
        if len(outputs) != 1:
            raise TopologyError(f"processor {ctx.name!r}: expected one features output besides the shadow topic")
        shadow = settings.shadow_feature_set
        fs = load_feature_set(ctx.topology.path(settings.feature_set))
        return cls(input_codec=ctx.codec(source), output_codec=ctx.codec(outputs[0]), source_topic=source,
                   output_topic=outputs[0],
                   dlq_topic=ctx.dlq, redis_url=ctx.stack.redis_url, settings=settings, feature_set=fs,
                   shadow_feature_set=load_feature_set(ctx.topology.path(shadow)) if shadow else None,
                   shadow_topic=settings.shadow_topic, project=ctx.topology.app,
                   redis_guard=ctx.calls.guard("redis", REDIS_FAILURES), table=cls._table(ctx, fs))

    @staticmethod
    def _table(ctx: BuildContext, fs: FeatureSet) -> tuple[VersionedTable, TableFollower] | None:
        """The entity table the feature set joins, and its follower (restored in :meth:`setup`)."""
        if fs.enrichment is None:
            return None
        # the processor's table, as its inputs and outputs are its topics (a namespaced copy renames them all);
        # the feature set's name picks one when it declares several
        tables = ctx.spec.tables
        topic = fs.enrichment.table if fs.enrichment.table in tables else tables[0] if len(tables) == 1 else None
        if topic is None:
            raise TopologyError(f"processor {ctx.name!r}: feature set {fs.name!r} joins {fs.enrichment.table!r}; "
                                f"declare the table under the processor's `tables:` (it has {tables or 'none'})")
        if ctx.topology.topics[topic].schema_ != fs.enrichment.schema_:
            raise TopologyError(f"feature set {fs.name!r}: table {topic!r} carries "
                                f"{ctx.topology.topics[topic].schema_!r}, not {fs.enrichment.schema_!r}")
        table_codec = ctx.codec(topic)
        fields = {f["name"] for f in ctx.topology.schema(fs.enrichment.schema_)["fields"]}
        if lacking := [a for a in fs.enrichment.used if a not in fields]:
            raise TopologyError(f"feature set {fs.name!r}: table {topic!r} has no attribute(s) {lacking}")
        table = VersionedTable(fs.enrichment.used)
        kafka = ctx.stack.kafka.config({"group.id": ctx.topology.group(ctx.name)})
        return table, TableFollower(kafka, topic, table_codec.decode, table)

    def setup(self) -> None:
        self.progress.processor = self.name  # the name the topology gave this processor (set after __init__)
        self.store.setup()
        if self.follower is not None:  # the whole table before the first reading joins it
            self.follower.restore()
            self.follower.start()

    def ready(self) -> bool:
        return self.store.ready()

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        columns, records = self._decode(batch, outputs)
        if not records:
            return outputs
        fs, windows = self.fs, self.windows
        key, ts_field = fs.entity.join_key, fs.source.timestamp_field
        entities, n = columns[key], len(records)
        partitions = np.fromiter((r.partition for r in records), dtype=np.int64, count=n)
        offsets = np.fromiter((r.offset for r in records), dtype=np.int64, count=n)
        if unknown := windows.unknown(partitions):
            for partition, closed_through in self.progress.start(unknown).items():
                windows.start(partition, closed_through)
        reread = self.progress.reread(partitions, offsets)
        ts = np.asarray(columns[ts_field], dtype=np.int64)
        values = np.column_stack([columns[name] for name in fs.inputs])
        self.progress.advance(partitions, offsets)
        now = time.monotonic()
        for partition in np.unique(partitions).tolist():
            self._heard[partition] = now
        verdicts = self.join.readings(entities, ts, values) if self.join is not None else None
        result = windows.add(windows.ids(entities), partitions, ts, values, records, reread,
                             excluded=None if verdicts is None or verdicts.keep.all() else ~verdicts.keep)
        if verdicts is not None:  # what a re-read after a restart decided was counted and dead-lettered then
            told = result.late if reread is None else result.late | reread
            self.join.count(verdicts, told)
            for i in np.flatnonzero(verdicts.unknown & ~told).tolist():
                outputs.append(dead_letter(records[i], self.dlq_topic, self.name,
                                           f"{key} {entities[i]} has no version in table {self.follower.topic} "
                                           f"at {int(ts[i])}", "unknown_entity"))
        if again := int(result.reread.sum()):
            REREAD.labels(self.name).inc(again)
        for i in np.flatnonzero(result.late).tolist():
            LATE.labels(self.name).inc()
            outputs.append(dead_letter(records[i], self.dlq_topic, self.name,
                                       f"reading at {int(ts[i])} is late: its windows are already closed", "late"))
        dead = result.late if verdicts is None else result.late | verdicts.unknown
        if dead.any():  # recorded at the next flush: a restart does not dead-letter them again
            self.progress.dead_lettered(np.unique(partitions[dead]).tolist())
        if self.shadow is not None:
            if verdicts is not None and not verdicts.keep.all():  # the shadow version sees the stream the live one does
                kept = np.flatnonzero(verdicts.keep)
                records, entities, ts, values = [records[i] for i in kept], [entities[i] for i in kept], ts[kept], values[kept]
            self._shadow(records, entities, ts, values, outputs)
        if result.closed:
            outputs.extend(self._emit(result.closed))
        outputs.extend(self._close_quiet(now))
        return outputs

    def idle(self) -> list[Output]:
        """Nothing was fetched: close the windows of partitions quiet for ``idle_partition_s``."""
        return self._close_quiet(time.monotonic())

    def _close_quiet(self, now: float) -> list[Output]:
        """The windows of every partition that brought no reading for ``idle_partition_s``, closed and emitted:
        a quiet partition holds neither its last windows nor, once it sends again, its committed offset."""
        closed, outputs = [], []
        for partition, heard in self._heard.items():
            if now - heard >= self.settings.idle_partition_s and self.windows.has_open(partition):
                quiet = self.windows.close_partition(partition)
                IDLE_CLOSED.labels(self.name).inc(len(quiet))
                log.info("%s: %s[%d] quiet for %.0fs: %d open windows closed", self.name, self.progress.topic,
                         partition, now - heard, len(quiet))
                self.progress.closed(partition)
                closed += quiet
                if self.shadow is not None:
                    differences = self.shadow.close_partition(TopicPartition(self.progress.topic, partition))
                    outputs += self._sampled(differences, quiet[0].last)
        return (self._emit(closed) if closed else []) + outputs

    def _decode(self, batch: list[Record], outputs: list[Output]) -> tuple[dict, list[Record]]:
        """The batch's columns (entity, event time, inputs with NaN for null) and the records they came from.

        One call for the whole batch when every value is in the input schema; otherwise record by record,
        each undecodable value dead-lettered with its reason.
        """
        fs = self.fs
        wanted = (fs.entity.join_key, fs.source.timestamp_field, *fs.inputs)
        if self._batch_in is not None:
            columns = self._batch_in.decode([r.value for r in batch], only=wanted, nulls_as_nan=True)
            if columns is not None:
                return columns, batch
        rows, records = [], []
        for record in batch:
            try:
                rows.append(self.input_codec.decode(record.value))
                records.append(record)
            except WireFormatError as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
        columns = {name: [row[name] for row in rows] for name in wanted[:2]}
        columns.update({name: np.array([np.nan if row[name] is None else row[name] for row in rows], dtype=np.float64)
                        for name in fs.inputs})
        return columns, records

    def _emit(self, closed: list[Closed]) -> list[Output]:
        """The output records of the windows a batch closed (one batch encode), staged for the online store."""
        fs = self.fs
        counts, features = self.windows.features(closed)
        if self.join is not None:
            features = np.hstack([features, self.join.attributes([(c.entity, c.start) for c in closed])])
        starts = np.fromiter((c.start for c in closed), dtype=np.int64, count=len(closed))
        entities = [c.entity for c in closed]
        bounds = {"window_start": starts, "window_end": starts + fs.window.size_ms, "count": counts}
        columns = {fs.entity.join_key: entities, **bounds,
                   **{name: features[:, j] for j, name in enumerate(fs.feature_names)}}
        encoded = self._batch_out.encode(columns, len(closed))
        layout = self.layout  # the online rows, packed from the same columns
        event_ms = bounds[layout.event_time_field]
        self.store.stage_packed(entities, event_ms.tolist(),
                                layout.pack_columns([bounds[f] for f in layout.int_fields], features, event_ms))
        outputs = []
        for c, value in zip(closed, encoded):
            # the trace of the window's own newest reading; the ingest time of the reading that closed it
            # (another entity's, perhaps: the stream time is the partition's), where the window's latency starts
            headers = carry_headers(c.last, **{H_EVENT_ID: f"{c.entity}:{c.start}"})
            if c.closer is not None and H_INGEST_MS in c.closer.headers:
                headers[H_INGEST_MS] = c.closer.headers[H_INGEST_MS]
            outputs.append(Output(self.output_topic, c.entity, value, headers))
        if self.shadow is not None:
            names = fs.columns
            for i, c in enumerate(closed):
                row = dict(zip(names, (c.entity, int(starts[i]), int(starts[i]) + fs.window.size_ms, int(counts[i]),
                                       *features[i].tolist())))
                outputs.extend(self._sampled(self.shadow.live(c.entity, row), c.last))
        return outputs

    def _shadow(self, records: list[Record], entities: list[str], ts: np.ndarray, values: np.ndarray,
                outputs: list[Output]) -> None:
        """Feed the shadow version's windows, reading by reading (only when a shadow version is configured)."""
        for i, record in enumerate(records):
            position = (TopicPartition(record.topic, record.partition), record.offset)
            differences = self.shadow.add(entities[i], int(ts[i]), values[i].tolist(), position)
            outputs.extend(self._sampled(differences, record))

    def _sampled(self, differences: list[dict], record: Record) -> list[Output]:
        """One differing shadow row in ``shadow_sample_every``, as JSON on the shadow topic."""
        out = []
        for difference in differences:
            self._differences += 1
            if (self._differences - 1) % self.settings.shadow_sample_every == 0:
                out.append(Output(self.shadow_topic, difference["entity"], encode_difference(difference),
                                  carry_headers(record)))
        return out

    def flush(self) -> Future | None:
        """Write the emitted windows to the online store, and how far the engine got, in one round trip (after
        the broker acknowledged the batch's outputs; the progress with the last command), in the writer's
        thread: the delivery loop reads and processes the next batch while Redis writes, and commits this one's
        offsets when the write is done. A batch that closed no window and dead-lettered nothing has nothing to
        write: no round trip (``streams.features.progress``)."""
        return self.store.flush_async((self.progress.key, self.progress.fields(self.windows)))

    def committable(self, partition: TopicPartition) -> int | None:
        firsts = [offset] if (offset := self.windows.first_open_offset(partition.partition)) is not None else []
        if self.shadow is not None:
            firsts += [offset for tp, offset in self.shadow.open_positions() if tp == partition]
        return min(firsts) if firsts else None

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Forget the entities of revoked partitions: their new owner rebuilds their windows from the committed offsets."""
        gone = {p.partition for p in partitions}
        self.windows.forget(gone)
        self.progress.forget(gone)
        self._heard = {p: t for p, t in self._heard.items() if p not in gone}

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
        self.store.close()
