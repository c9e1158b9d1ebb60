"""Dead-letter topics: look at what was refused and why, and send it back after a fix.

``inspect`` reads a DLQ from the beginning (or ``--from-offset``) to its end as it is now;
``replay`` sends the records (optionally only one reason) to a topic, normally the stage's
input, with their original key and value and headers, minus the ``dlq.*`` ones, plus
``dlq.replayed_from`` (``topic[partition]@offset``). Both read with ``assign`` and a
throwaway group id and never commit, so no consumer group of a processor is touched.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from streams.errors import DeliveryError, TangramError
from streams.security.kafka import KafkaConnection

log = logging.getLogger("tangram.dlq")

TIMEOUT_S = 10.0


class DlqError(TangramError):
    """A dead-letter topic cannot be read or replayed."""


@dataclass(frozen=True)
class DeadLetter:
    """One DLQ record, with the headers the delivery loop and the gateways write."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def header(self, name: str) -> str:
        for k, v in self.headers:
            if k == name:
                return v.decode("utf-8", "replace") if v is not None else ""
        return ""

    @property
    def reason(self) -> str:
        return self.header("dlq.reason")

    @property
    def source(self) -> str:
        topic = self.header("dlq.source_topic")
        partition, offset = self.header("dlq.source_partition"), self.header("dlq.source_offset")
        return f"{topic}[{partition}]@{offset}" if partition not in ("", "-1") else topic


def _consumer(kafka: KafkaConnection) -> Consumer:
    return Consumer(kafka.config({
        "group.id": f"tangram-dlq-reader-{uuid.uuid4().hex}",  # never used to commit
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",  # --from-offset below the retention start reads from the start
    }))


def read(kafka: KafkaConnection, topic: str, *, from_offset: int = 0, reason: str | None = None,
         limit: int | None = None) -> Iterator[DeadLetter]:
    """The records of ``topic`` from ``from_offset`` (every partition) up to its end at call time, in offset order per partition."""
    consumer = _consumer(kafka)
    try:
        metadata = consumer.list_topics(topic, timeout=TIMEOUT_S).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise DlqError(f"topic {topic!r} does not exist at {kafka}; "
                           "DLQ topics are `<app>.dlq.<stage>`, created by `tangram apply`")
        ends: dict[int, int] = {}
        for p in metadata.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT_S)
            if high > max(low, from_offset):
                ends[p] = high
        if not ends:
            return
        consumer.assign([TopicPartition(topic, p, from_offset) for p in ends])
        yielded, pending = 0, dict(ends)
        while pending:
            for msg in consumer.consume(500, 1.0):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.pop(msg.partition(), None)
                        continue
                    raise DlqError(f"reading {topic}: {err.str()}")
                if msg.offset() >= pending.get(msg.partition(), -1):
                    pending.pop(msg.partition(), None)
                    continue
                if msg.offset() + 1 >= pending[msg.partition()]:
                    pending.pop(msg.partition())
                letter = DeadLetter(topic, msg.partition(), msg.offset(), msg.key(), msg.value(), tuple(msg.headers() or ()))
                if reason is None or letter.reason == reason:
                    yield letter
                    yielded += 1
                    if limit is not None and yielded >= limit:
                        return
    except KafkaException as exc:
        raise DlqError(f"cannot read {topic} at {kafka}: {exc}; is the stack up (`tangram up`)?") from exc
    finally:
        consumer.close()


def replay(kafka: KafkaConnection, topic: str, to: str, *, reason: str | None = None, from_offset: int = 0,
           limit: int | None = None, dry_run: bool = False) -> int:
    """Send the DLQ records of ``topic`` (of one ``reason``) to ``to``; returns how many, once all are acknowledged."""
    letters = list(read(kafka, topic, from_offset=from_offset, reason=reason, limit=limit))
    if dry_run or not letters:
        return len(letters)
    producer = Producer(kafka.config({"enable.idempotence": True, "acks": "all",
                                      "client.id": f"tangram-dlq-replay-{uuid.uuid4().hex[:8]}"}))
    failures: list[str] = []

    def settled(err: KafkaError | None, msg) -> None:
        if err is not None:
            failures.append(err.str())

    for letter in letters:
        headers = [(k, v) for k, v in letter.headers if not k.startswith("dlq.")]
        headers.append(("dlq.replayed_from", f"{letter.topic}[{letter.partition}]@{letter.offset}".encode()))
        while True:
            try:
                producer.produce(to, letter.value, letter.key, headers=headers, on_delivery=settled)
                break
            except BufferError:
                producer.poll(0.1)
    remaining = producer.flush(30)
    if remaining or failures:
        raise DeliveryError(f"replay to {to}: {remaining} unacknowledged, {len(failures)} failed "
                            f"({'; '.join(failures[:3])}); replaying again is safe: ingest drops duplicates by event_id")
    log.info("replayed %d records from %s to %s", len(letters), topic, to)
    return len(letters)
