"""``tangram trace APP EVENT_ID``: the path of one event through every stage, with per-stage times.

It follows the event as the data does: the raw record (its value carries the
``event_id``) → the validated record on the ingest topic (``event_id`` header) or
its dead letter → the window of its entity (the record key) that contains its event
time (the ingest processor's declared ``time_field``) → the prediction for that window
→ the actions decided on it. Each hop shows
the record's place (``topic[partition]@offset``), its produce time, the time
since the reading entered Kafka, and its ``trace_id``/``traceparent`` header.
Topics are read with ``assign`` from a little before the reading; nothing is committed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from confluent_kafka import Consumer, TopicPartition
from rich.console import Console
from rich.table import Table

from streams.avro import topic_codec
from streams.errors import TopologyError
from streams.ingest import IngestSettings
from streams.rules.spec import RulesSettings
from streams.settings import StackSettings
from streams.topology import Kind, Topology


@dataclass(frozen=True)
class Hop:
    stage: str
    where: str
    timestamp_ms: int
    detail: str
    trace: str


def _scan(stack: StackSettings, topology: Topology, topic: str, since_ms: int, match, timeout_s: float = 20.0) -> list:
    """Records of ``topic`` from ``since_ms`` to its current end for which ``match(msg)`` holds."""
    consumer = Consumer(stack.kafka.config({"group.id": f"tangram-trace-{uuid.uuid4().hex}",
                                            "enable.auto.commit": False}))
    try:
        parts = range(topology.partitions(topic))
        starts = consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in parts], timeout=10)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
        todo = {tp.partition: ends[tp.partition] for tp in starts if 0 <= tp.offset < ends[tp.partition]}
        consumer.assign([tp for tp in starts if tp.partition in todo])
        found, deadline = [], time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            for msg in consumer.consume(2000, 0.5):
                if msg.error():
                    continue
                if match(msg):
                    found.append(msg)
                if msg.offset() + 1 >= todo.get(msg.partition(), 0):
                    todo.pop(msg.partition(), None)
        return found
    finally:
        consumer.close()


def _headers(msg) -> dict[str, str]:
    return {k: v.decode("utf-8", "replace") for k, v in (msg.headers() or [])}


def _hop(stage: str, msg, detail: str) -> Hop:
    h = _headers(msg)
    return Hop(stage, f"{msg.topic()}[{msg.partition()}]@{msg.offset()}", msg.timestamp()[1], detail,
               h.get("traceparent") or h.get("trace_id", ""))


def trace(stack: StackSettings, topology: Topology, event_id: str, lookback_s: float = 3600.0) -> list[Hop]:
    """Every hop of ``event_id``'s event, in order. Raises TopologyError when the event is not found."""
    ingests = topology.processors_of(Kind.INGEST)
    if not ingests:
        raise TopologyError(f"tracing follows an ingest processor's records; app {topology.app!r} has none")
    ingest_name, ingest = next(iter(ingests.items()))
    since = int(time.time() * 1000 - lookback_s * 1000)
    needle = event_id.encode()
    raw = _scan(stack, topology, ingest.inputs[0], since, lambda m: m.value() is not None and needle in m.value())
    if not raw:
        raise TopologyError(f"no reading with event_id {event_id!r} on {ingest.inputs[0]} in the last {lookback_s:.0f}s")
    hops = [_hop("producer", raw[0], f"key {raw[0].key().decode('utf-8', 'replace') if raw[0].key() else '-'}")]
    since = raw[0].timestamp()[1] - 60_000
    accepted = _scan(stack, topology, ingest.outputs[0], since, lambda m: _headers(m).get("event_id") == event_id)
    if not accepted:
        dead = _scan(stack, topology, ingest.dlq, since,
                     lambda m: m.value() is not None and needle in m.value()) if ingest.dlq else []
        for msg in dead[:1]:
            h = _headers(msg)
            hops.append(_hop("ingest → DLQ", msg, f"{h.get('dlq.reason')}: {h.get('dlq.error_message', '')[:80]}"))
        return hops
    reading = topic_codec(topology, stack.registry_url, ingest.outputs[0]).decode(accepted[0].value())
    fields = IngestSettings.model_validate(ingest.params)
    entity, ts = reading[fields.entity_field], reading[fields.time_field]
    hops.append(_hop(ingest_name, accepted[0], f"{entity} {fields.time_field}={ts}"))
    key = str(entity).encode()
    stages = [(n, p) for n, p in topology.processors.items() if n != ingest_name]
    windows: list[dict] = []
    for name, spec in stages:  # the window processor: reads the ingest topic
        if ingest.outputs[0] not in spec.inputs or not spec.outputs:
            continue
        out = spec.outputs[0]
        subject = topology.topics[out].schema_
        if not subject:
            continue
        c = topic_codec(topology, stack.registry_url, out)
        for msg in _scan(stack, topology, out, since, lambda m: m.key() == key):
            w = c.decode(msg.value())
            if w.get("window_start", ts + 1) <= ts < w.get("window_end", ts):
                windows.append(w)
                hops.append(_hop(name, msg, f"window [{w['window_start']}, {w['window_end']}) of {w.get('count', '?')} readings"))
        feature_topic = out
        for pname, pspec in stages:  # the model: reads the feature topic
            if feature_topic not in pspec.inputs or pspec.kind != Kind.INFERENCE:
                continue
            pout = pspec.outputs[0]
            pc = topic_codec(topology, stack.registry_url, pout)
            starts = {w["window_start"] for w in windows}
            for msg in _scan(stack, topology, pout, since, lambda m: m.key() == key):
                p = pc.decode(msg.value())
                if p["window_start"] in starts:
                    hops.append(_hop(pname, msg, f"{p['label']} score={p['score']:.3f} model v{p['model_version']}"))
    ends = {w["window_end"] for w in windows}
    for name, spec in topology.processors_of(Kind.RULES).items():
        time_field = RulesSettings.model_validate(spec.params).time_field
        for topic in spec.outputs:
            ac = topic_codec(topology, stack.registry_url, topic)
            for msg in _scan(stack, topology, topic, since, lambda m: m.key() == key):
                a = ac.decode(msg.value())
                if a.get(time_field) in ends:
                    hops.append(_hop(name, msg, f"{a['action_type']} by rule {a['rule']} ({a.get('degradation_level', 'L0')})"))
    return sorted(hops, key=lambda h: h.timestamp_ms)


def print_trace(event_id: str, hops: list[Hop], console: Console) -> None:
    t0 = hops[0].timestamp_ms
    table = Table(title=f"trace of {event_id}")
    for col in ("stage", "record", "produced (UTC)", "+ms", "what", "trace"):
        table.add_column(col, justify="right" if col == "+ms" else "left")
    for h in hops:
        when = datetime.fromtimestamp(h.timestamp_ms / 1000, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        table.add_row(h.stage, h.where, when, f"{h.timestamp_ms - t0:,}", h.detail, h.trace[:40])
    console.print(table)
