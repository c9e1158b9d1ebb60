"""Every event of a run accounted for, by id: what the first stage accepted, dead-lettered, duplicated or
lost, the windows the feature stage had to emit from what it accepted, and one prediction per window.

A fault campaign (:mod:`streams.chaos`) counts what the broker acknowledged of its load, then asks an
:class:`Audit` of the topics what became of each event once the chain is quiet. Every event of a
campaign's load is valid, so every dead letter but those of the deliberately oversized records is a
finding (``false_dead_letters``). Records are read ``read_committed``: in exactly-once mode what an
aborted transaction wrote is not counted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from confluent_kafka import Consumer, TopicPartition

from streams.avro import topic_codec
from streams.features.spec import load_feature_set
from streams.launcher import high_watermarks
from streams.settings import StackSettings
from streams.testing import expected_windows
from streams.topology import Kind, Topology


@dataclass
class Accounting:
    sent: int = 0  # acknowledged by the broker
    produced: int = 0  # handed to the producer
    refused_by_broker: int = 0  # over the size limit: never in Kafka
    accepted: int = 0  # distinct events on the first stage's output
    duplicated: int = 0  # extra copies on the first stage's output
    lost: int = 0  # sent, neither accepted nor dead-lettered
    dead_letters: dict[str, int] = field(default_factory=dict)  # "<stage>:<reason>" → records
    false_dead_letters: dict[str, int] = field(default_factory=dict)  # of valid events, by "<stage>:<reason>"
    windows_expected: int = 0
    windows_delivered: int = 0
    windows_missing: int = 0
    windows_incomplete: int = 0  # emitted with fewer readings than were accepted for it
    windows_inflated: int = 0  # emitted with more: a reading the first stage duplicated, counted twice
    windows_duplicated: int = 0
    predictions_missing: int = 0
    predictions_duplicated: int = 0
    oversize_sent: int = 0  # the record just under the limit (its dead letter is over it)
    oversize_refused: int = 0  # the record over the limit: refused by the producer, never in Kafka
    oversize_dead_lettered: int = 0  # dead letters of the record sent (keyed ``oversize``)
    oversize_truncated: int = 0  # of those, kept truncated (``dlq.truncated_from_bytes`` in their headers)

    @property
    def acknowledged(self) -> bool:
        """Something was sent and the broker acknowledged all of it."""
        return self.sent > 0 and self.sent == self.produced and self.refused_by_broker == 0

    @property
    def ok(self) -> bool:
        """Nothing lost: something was sent, all of it acknowledged, every event, window and prediction there."""
        return (self.acknowledged and self.lost == 0
                and self.windows_missing == 0 and self.windows_incomplete == 0 and self.predictions_missing == 0)

    def clean(self, exactly_once: bool) -> bool:
        """``ok``, no dead letter of a valid event and, in exactly-once mode, no duplicate."""
        duplicates = self.duplicated + self.windows_duplicated + self.predictions_duplicated
        return self.ok and not self.false_dead_letters and (not exactly_once or duplicates == 0)


class Audit:
    """Reads a topology's topics to account for every event (:meth:`account`)."""

    def __init__(self, topology: Topology, stack: StackSettings, group: str, probe: Callable[[], Consumer]):
        """``group``: the consumer group the reads use; ``probe``: the consumer that reads the topics' ends (the
        campaign replaces it after a broker's loss)."""
        self.topology, self.stack, self.group, self.probe = topology, stack, group, probe

    def account(self, acked: Counter, produced: int, failed: int, oversize: tuple[int, int]) -> Accounting:
        """What became of the events the broker ``acked`` (by event id; ``produced`` handed to the producer,
        ``failed`` refused) and of the ``oversize`` records (sent just under the limit, refused over it)."""
        topology = self.topology
        a = Accounting()
        a.sent, a.produced = sum(acked.values()), produced
        a.refused_by_broker = failed
        a.oversize_sent, a.oversize_refused = oversize
        valid = {e for e in acked if e}
        ingest_name, ingest = next((n, p) for n, p in topology.processors.items() if topology.simulator.source in p.inputs)
        accepted_topic = ingest.outputs[0]
        accepted = self._read(accepted_topic)
        ids = Counter(_header(m, "event_id") for m in accepted)
        a.accepted = len(set(ids) & valid)
        a.duplicated = sum(n - 1 for e, n in ids.items() if e in valid)
        dead: Counter = Counter()
        false: Counter = Counter()
        dead_ids: set[str] = set()
        stages = {p.dlq: n for n, p in topology.processors.items() if p.dlq}
        for dlq, stage in stages.items():
            for m in self._read(dlq):
                reason = f"{stage}:{_header(m, 'dlq.reason')}"
                dead[reason] += 1
                event = _header(m, "event_id") or (event_id(m.value()) if stage == ingest_name else "")
                if stage == ingest_name:
                    dead_ids.add(event)
                if (m.key() or b"") == b"oversize":
                    a.oversize_dead_lettered += 1
                    a.oversize_truncated += 1 if _header(m, "dlq.truncated_from_bytes") else 0
                else:
                    false[reason] += 1  # every event of the load is valid: no dead letter is expected
        a.dead_letters, a.false_dead_letters = dict(dead), dict(false)
        a.lost = len(valid - set(ids) - dead_ids)
        self._windows(a, accepted, accepted_topic)
        return a

    def _windows(self, a: Accounting, accepted: list, accepted_topic: str) -> None:
        topology = self.topology
        features = next(iter(topology.processors_of(Kind.FEATURES).items()), None)
        if features is None:
            return
        name, spec = features
        fs = load_feature_set(topology.path(spec.params["feature_set"]))
        decode = topic_codec(topology, self.stack.registry_url, accepted_topic).decode
        readings: dict[str, dict] = {}  # by event id, in the order the stage read them: each counted once
        for m in accepted:
            readings.setdefault(_header(m, "event_id"), decode(m.value()))
        # each partition's stream time closes its windows, as in the engines (those still open at the end
        # are not counted: the idle timeout may or may not have closed them yet)
        expected, _ = expected_windows(list(readings.values()), fs, topology.partitions(accepted_topic))
        out_topic = spec.outputs[0]
        out_decode = topic_codec(topology, self.stack.registry_url, out_topic).decode
        key = fs.entity.join_key
        rows: dict[tuple[str, int], list[dict]] = {}
        for m in self._read(out_topic):
            row = out_decode(m.value())
            rows.setdefault((row[key], row["window_start"]), []).append(row)
        a.windows_expected, a.windows_delivered = len(expected), len(set(rows) & set(expected))
        a.windows_missing = len(set(expected) - set(rows))
        a.windows_duplicated = sum(len(v) - 1 for v in rows.values())
        a.windows_incomplete = sum(1 for k, v in rows.items() if k in expected
                                   and max(r["count"] for r in v) < expected[k]["count"])
        a.windows_inflated = sum(1 for k, v in rows.items() if k in expected
                                 and max(r["count"] for r in v) > expected[k]["count"])
        inference = next(iter(topology.processors_of(Kind.INFERENCE).values()), None)
        if inference is None:
            return
        predictions = Counter()
        p_decode = topic_codec(topology, self.stack.registry_url, inference.outputs[0]).decode
        for m in self._read(inference.outputs[0]):
            p = p_decode(m.value())
            predictions[(p[key], p["window_start"])] += 1
        a.predictions_missing = len(set(rows) - set(predictions))
        a.predictions_duplicated = sum(n - 1 for n in predictions.values())

    def _read(self, topic: str) -> list:
        """Every record of ``topic`` (read_committed), from the start to its end now."""
        ends = high_watermarks(self.probe(), self.topology, [topic])
        consumer = Consumer(self.stack.kafka.config({"group.id": self.group,
                             "enable.auto.commit": False, "isolation.level": "read_committed",
                             "fetch.max.bytes": 2_000_000, "max.partition.fetch.bytes": 2_000_000}))
        consumer.assign([TopicPartition(tp.topic, tp.partition, 0) for tp in ends])
        out, done = [], {tp for tp, end in ends.items() if end == 0}
        deadline = time.monotonic() + 120
        try:
            while len(done) < len(ends) and time.monotonic() < deadline:
                for m in consumer.consume(1000, 1.0):
                    if m.error():
                        continue
                    out.append(m)
                    tp = TopicPartition(m.topic(), m.partition())
                    if m.offset() + 1 >= ends[tp]:
                        done.add(tp)
                if len(done) < len(ends):  # transaction markers and aborted records end a partition short
                    for tp in ends:
                        if tp not in done:
                            position = consumer.position([TopicPartition(tp.topic, tp.partition)])[0].offset
                            if position >= ends[tp]:
                                done.add(tp)
        finally:
            consumer.close()
        return out


def _header(msg, name: str) -> str:  # noqa: ANN001 - confluent-kafka's Message
    return dict(msg.headers() or []).get(name, b"").decode("utf-8", "replace")


def event_id(value: bytes | None) -> str:
    """The ``event_id`` field of a JSON event ('' when it has none or is not JSON)."""
    try:
        return str(orjson.loads(value).get("event_id", "")) if value else ""
    except (orjson.JSONDecodeError, AttributeError):
        return ""


__all__ = ["Accounting", "Audit", "event_id"]
