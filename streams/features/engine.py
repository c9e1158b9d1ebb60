"""The embedded feature engine: a ``Processor`` in the one delivery loop (``streams.delivery``).

Event-time windows per entity, as the feature set declares them, closed when the entity's
watermark (its newest event time) passes the window end plus the allowed lateness.
Readings for a window already closed are late: counted and sent to the DLQ, never dropped.

State and offsets: open windows live in memory; the committed offset of a partition never
passes the first offset of a window still open there, so a restarted job rebuilds its
windows by re-reading. Windows already emitted are recognised by the ``window_end`` stored
with the entity in the online store (written after the broker acknowledged the window,
before the commit) and are not emitted twice.

The online store is Feast's Redis store (``streams.features.layout``): the newest row of each
entity under the Feast project named after the topology's ``app`` (so a namespaced copy of the
topology, a replay or a test, writes its own project), ``FeatureStore.get_online_features``
serves it and the rules read it (``online_layout``).
"""

from __future__ import annotations

import logging

import numpy as np
from confluent_kafka import TopicPartition
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, H_TRACE_ID, Output, Processor, Record, carry_headers, dead_letter
from streams.features.compute import EntityWindows, output_row
from streams.errors import TopologyError
from streams.features.layout import FeastLayout
from streams.features.online import OnlineWriter
from streams.features.shadow import ShadowComparator
from streams.features.shadow import encode as encode_difference
from streams.features.spec import FeatureSet, load_feature_set
from streams.resilience import REDIS_FAILURES, Guard
from streams.topology import Topology

log = logging.getLogger("tangram.features")

LATE = Counter("tangram_features_late_records_total", "Readings that arrived after their window closed.", ["processor"])


class WindowFeaturesSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    feature_set: str = Field(description="The feature-set declaration (YAML), relative to the app folder.")
    shadow_feature_set: str | None = Field(None, description="A new version of the feature set, computed beside the live "
                                                             "one and compared with it; never served.")
    shadow_topic: str | None = Field(None, description="Where differing shadow rows are sampled (JSON); an output.")
    shadow_sample_every: int = Field(1, ge=1, description="Send one differing row in N to the shadow topic.")


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

    def __init__(self, *, input_codec: AvroCodec, output_codec: AvroCodec, output_topic: str, dlq_topic: str,
                 redis_url: str, settings: WindowFeaturesSettings, feature_set: FeatureSet,
                 shadow_feature_set: FeatureSet | None = None, shadow_topic: str | None = None,
                 project: str = "tangram", redis_guard: Guard | None = None):
        self.input_codec = input_codec
        self.output_codec = output_codec
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.settings = settings
        self.fs = feature_set
        self.layout = FeastLayout.of(self.fs, project)
        self.store = OnlineWriter(redis_url, self.layout, guard=redis_guard)  # Redis down: backpressure
        self._entities: dict[str, EntityWindows] = {}
        self.shadow_topic = shadow_topic
        self.shadow = ShadowComparator(self.fs, shadow_feature_set, self.name) if shadow_feature_set else None
        self._differences = 0

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
        return cls(input_codec=ctx.codec(source), output_codec=ctx.codec(outputs[0]), output_topic=outputs[0],
                   dlq_topic=ctx.dlq, redis_url=ctx.stack.redis_url, settings=settings,
                   feature_set=load_feature_set(ctx.topology.path(settings.feature_set)),
                   shadow_feature_set=load_feature_set(ctx.topology.path(shadow)) if shadow else None,
                   shadow_topic=settings.shadow_topic, project=ctx.topology.app,
                   redis_guard=ctx.calls.guard("redis", REDIS_FAILURES))

    def setup(self) -> None:
        self.store.setup()

    def ready(self) -> bool:
        return self.store.ready()

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        decoded: list[tuple[Record, dict]] = []
        for record in batch:
            try:
                decoded.append((record, self.input_codec.decode(record.value)))
            except WireFormatError as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
        key, ts_field, inputs = self.fs.entity.join_key, self.fs.source.timestamp_field, self.fs.inputs
        self._load_emitted({value[key] for _, value in decoded})
        for record, value in decoded:
            entity, ts = value[key], value[ts_field]
            row = [np.nan if value[s] is None else value[s] for s in inputs]
            position = (TopicPartition(record.topic, record.partition), record.offset)
            if self.shadow is not None:
                outputs.extend(self._sampled(self.shadow.add(entity, ts, row, position), record))
            accepted, closed = self._entities[entity].add(ts, row, position, record)
            if not accepted:
                LATE.labels(self.name).inc()
                outputs.append(dead_letter(record, self.dlq_topic, self.name,
                                           f"reading at {ts} is late: its windows are already closed", "late"))
                continue
            for window in closed:
                out = output_row(self.fs, entity, window)
                headers = carry_headers(record, **{H_EVENT_ID: f"{entity}:{window['start']}"})
                last = window["window"].last
                if H_TRACE_ID not in headers and last is not None:
                    headers.update(carry_headers(last))
                outputs.append(Output(self.output_topic, entity, self.output_codec.encode(out), headers))
                self.store.stage(out)
                if self.shadow is not None:
                    outputs.extend(self._sampled(self.shadow.live(entity, out), record))
        return outputs

    def _sampled(self, differences: list[dict], record: Record) -> list[Output]:
        """One differing shadow row in ``shadow_sample_every``, as JSON on the shadow topic."""
        out = []
        for difference in differences:
            self._differences += 1
            if (self._differences - 1) % self.settings.shadow_sample_every == 0:
                out.append(Output(self.shadow_topic, difference["entity"], encode_difference(difference),
                                  carry_headers(record)))
        return out

    def _load_emitted(self, entities: set[str]) -> None:
        """For entities first seen since start, read which windows were already emitted (online store)."""
        new = [e for e in entities if e not in self._entities]
        if not new:
            return
        for entity, end in zip(new, self.store.emitted_ends(new)):
            self._entities[entity] = EntityWindows(self.fs, emitted_end=end)

    def flush(self) -> None:
        """Write the emitted windows to the online store (after the broker acknowledged them)."""
        self.store.flush()

    def committable(self, partition: TopicPartition) -> int | None:
        firsts = [w.first[1] for state in self._entities.values() for w in state.open.values()
                  if w.first[0] == partition]
        if self.shadow is not None:
            firsts += [offset for tp, offset in self.shadow.open_positions() if tp == partition]
        return min(firsts) if firsts else None

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Forget every entity: open windows of kept partitions are rebuilt from the committed offsets."""
        gone = {(p.topic, p.partition) for p in partitions}
        for state in self._entities.values():
            state.open = {s: w for s, w in state.open.items() if (w.first[0].topic, w.first[0].partition) not in gone}
        kept = {e: s for e, s in self._entities.items() if s.open}
        self._entities = kept

    def close(self) -> None:
        self.store.close()
