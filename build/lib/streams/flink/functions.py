"""The Flink operators of the feature job, in their own module so workers import them by name.

``WindowFunction`` runs the shared per-entity state machine
(``streams.features.compute.EntityWindows``) in a ``KeyedProcessFunction`` keyed by the Kafka
key; the entity's state lives in Flink keyed state, so checkpoints carry it. Late and
undecodable readings go to the ``LATE`` side output with their original bytes and the reason.
Given a Redis URL, it also writes the newest row of each entity to the online store, Feast's
Redis layout (``streams.features.layout``), as the other engines do: after the windows of an element
closed, before their rows reach the Kafka sink; a job restored from a checkpoint recomputes and
rewrites them (Feast's rule keeps the newest ``window_end``, so the rewrite changes nothing).
"""

from __future__ import annotations

import time

from pyflink.common import Row, Types
from pyflink.datastream import KeyedProcessFunction, OutputTag, RuntimeContext
from pyflink.datastream.state import ValueStateDescriptor

from streams.errors import SchemaError
from streams.features.compute import EntityWindows, output_row
from streams.features.spec import FeatureSet, load_feature_set
from streams.wire import RegistryREST, WireCodec

CARRIED = ("event_id", "trace_id", "ingest_ms")
BYTES = Types.PRIMITIVE_ARRAY(Types.BYTE())
#: One Kafka record as the job sees it: key (the entity), value bytes, headers.
RECORD = Types.ROW_NAMED(["k", "v", "headers"], [Types.STRING(), BYTES, Types.MAP(Types.STRING(), BYTES)])
LATE = OutputTag("late", RECORD)


class WindowFunction(KeyedProcessFunction):
    """Raw Kafka records of one entity → output rows of the windows they close; late ones → side output."""

    def __init__(self, feature_set: str, registry_url: str, source_subject: str, output_subject: str,
                 source_topic: str, redis_url: str | None = None, project: str | None = None):
        self.feature_set, self.registry_url = feature_set, registry_url
        self.source_subject, self.output_subject, self.source_topic = source_subject, output_subject, source_topic
        self.redis_url, self.project = redis_url, project

    def open(self, ctx: RuntimeContext) -> None:
        self.fs: FeatureSet = load_feature_set(self.feature_set)
        registry = RegistryREST(self.registry_url)
        # the contracts as `tangram apply` registered them from the app: the job needs no schema files
        self.source = WireCodec(registry, self.source_subject)
        self.output = WireCodec(registry, self.output_subject)
        self.state = ctx.get_state(ValueStateDescriptor("entity", Types.PICKLED_BYTE_ARRAY()))
        self.store = None
        if self.redis_url:
            from streams.features.layout import FeastLayout
            from streams.features.online import OnlineWriter

            if not self.project:
                raise ValueError("the online store needs its Feast project (--project)")
            self.store = OnlineWriter(self.redis_url, FeastLayout.of(self.fs, self.project))
            self.store.setup()

    def close(self) -> None:
        if getattr(self, "store", None) is not None:
            self.store.close()

    def process_element(self, value: Row, ctx: KeyedProcessFunction.Context):
        headers = dict(value.headers or {})
        try:
            reading = self.source.decode(bytes(value.v))
        except SchemaError as exc:  # undecodable: dead letter, never dropped
            yield LATE, _dead_letter(value, headers, "undecodable", str(exc), self.source_topic)
            return
        fs = self.fs
        saved = self.state.value()
        windows = EntityWindows(fs)
        if saved is not None:
            windows.watermark, windows.emitted_end, windows.open = saved
        entity = reading[fs.entity.join_key]
        ts = reading[fs.source.timestamp_field]
        row = [float("nan") if reading[s] is None else float(reading[s]) for s in fs.inputs]
        carried = {k: v for k, v in headers.items() if k in CARRIED}
        accepted, closed = windows.add(ts, row, None, carried)
        self.state.update((windows.watermark, windows.emitted_end, windows.open))
        if not accepted:
            yield LATE, _dead_letter(value, headers, "late", f"reading at {ts} is late: its windows are already closed",
                                     self.source_topic)
            return
        rows = [output_row(fs, entity, window) for window in closed]
        if rows and self.store is not None:
            for row in rows:
                self.store.stage(row)
            self.store.flush()
        for window, row in zip(closed, rows):
            out_headers = {**(window["window"].last or {}), **carried, "event_id": f"{entity}:{window['start']}".encode()}
            yield Row(k=entity, v=self.output.encode(row), headers=out_headers)


def _dead_letter(value: Row, headers: dict, reason: str, message: str, source_topic: str) -> Row:
    extra = {"dlq.stage": "features-flink", "dlq.reason": reason, "dlq.error_class": "Rejected",
             "dlq.error_message": message[:1000], "dlq.source_topic": source_topic,
             "dlq.failed_ms": str(int(time.time() * 1000))}
    return Row(k=value.k, v=value.v, headers={**headers, **{k: v.encode() for k, v in extra.items()}})

