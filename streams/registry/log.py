"""The registry's durable log: the compacted ``_schemas`` Kafka topic.

Blocking confluent-kafka calls; the HTTP layer runs them in a worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from streams.errors import SchemaError, StackError
from streams.registry.store import Record

log = logging.getLogger("tangram.registry")

TOPIC = "_schemas"


class KafkaLog:
    """Create, replay and append to the registry topic (one partition, compacted)."""

    def __init__(self, bootstrap_servers: str, topic: str = TOPIC, timeout_s: float = 30.0) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.timeout_s = timeout_s
        self._producer: Producer | None = None

    def ensure_topic(self) -> None:
        """Create the topic (1 partition, replication 1, cleanup.policy=compact) if it is missing."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        try:
            metadata = admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise StackError(
                f"Kafka at {self.bootstrap_servers} is unreachable ({exc}); start the stack first."
            ) from exc
        if self.topic in metadata.topics:
            return
        new = NewTopic(self.topic, num_partitions=1, replication_factor=1, config={"cleanup.policy": "compact"})
        future = admin.create_topics([new], operation_timeout=self.timeout_s)[self.topic]
        try:
            future.result(timeout=self.timeout_s)
            log.info("created topic %s", self.topic)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise StackError(f"cannot create topic {self.topic}: {exc}") from exc

    def _watermarks(self, consumer: Consumer) -> tuple[int, int]:
        """The topic's offsets, asking again while a just-created partition has no leader yet."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=self.timeout_s)
            except KafkaException as exc:
                if not exc.args[0].retriable() and exc.args[0].code() != KafkaError.NOT_LEADER_FOR_PARTITION \
                        or time.monotonic() > deadline:
                    raise StackError(f"cannot read the offsets of {self.topic}: {exc}") from exc
                time.sleep(0.2)

    def replay(self) -> Iterator[Record]:
        """Every record from the beginning of the topic up to its current end (high watermark)."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": "tangram-registry-replay",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
            }
        )
        try:
            low, high = self._watermarks(consumer)
            if high <= low:
                return
            consumer.assign([TopicPartition(self.topic, 0, low)])
            position = low
            while position < high:
                msg = consumer.poll(self.timeout_s)
                if msg is None:
                    raise StackError(f"replay of {self.topic} stalled at offset {position} of {high}")
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        break
                    raise StackError(f"replay of {self.topic} failed: {msg.error()}")
                position = msg.offset() + 1
                key = msg.key()
                if key is None:
                    continue
                try:
                    yield Record.from_bytes(key, msg.value())
                except ValueError:
                    log.warning("skipping unreadable record at offset %d of %s", msg.offset(), self.topic)
        finally:
            consumer.close()

    def append(self, records: Iterable[Record]) -> None:
        """Produce records (idempotent, acks=all) and wait until the broker acknowledged all of them."""
        if self._producer is None:
            self._producer = Producer(
                {
                    "bootstrap.servers": self.bootstrap_servers,
                    "enable.idempotence": True,
                    "acks": "all",
                    "linger.ms": 0,
                    "message.timeout.ms": int(self.timeout_s * 1000),
                }
            )
        errors: list[str] = []

        def on_delivery(err: KafkaError | None, _msg: object) -> None:
            if err is not None:
                errors.append(str(err))

        count = 0
        for record in records:
            self._producer.produce(self.topic, record.value_bytes(), record.key_bytes(), on_delivery=on_delivery)
            count += 1
        remaining = self._producer.flush(self.timeout_s)
        if errors or remaining:
            raise SchemaError(
                f"the registry could not write {count} record(s) to {self.topic}: "
                f"{errors or f'{remaining} unacknowledged'}; is Kafka up?"
            )

    def close(self) -> None:
        """Flush and drop the producer."""
        if self._producer is not None:
            self._producer.flush(self.timeout_s)
            self._producer = None
