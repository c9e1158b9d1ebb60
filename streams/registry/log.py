"""The registry's durable log: the compacted ``_schemas`` Kafka topic.

A thin adapter over :class:`streams.statelog.StateTopic`, the one implementation of state
kept on a compacted topic (the model registry and the config center use it too): records
are the registry's own (Confluent-style JSON keys), errors are the registry's.
Blocking confluent-kafka calls; the HTTP layer runs them in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from streams.errors import SchemaError, StackError, StateLogError
from streams.security.kafka import KafkaConnection
from streams.statelog import LogRecord
from streams.statelog import StateTopic

log = logging.getLogger("tangram.registry")

TOPIC = "_schemas"


class KafkaLog:
    """Create, replay and append to the registry topic (one partition, compacted)."""

    def __init__(self, kafka: KafkaConnection, topic: str = TOPIC, timeout_s: float = 30.0,
                 replication_factor: int = -1) -> None:
        self.kafka = kafka
        self.topic = topic
        self._log = StateTopic(kafka, topic, timeout_s, replication_factor)

    def ensure_topic(self) -> None:
        """Create the topic (1 partition, compacted, the replication asked for) if it is missing."""
        try:
            self._log.ensure()
        except StateLogError as exc:
            raise StackError(str(exc)) from exc

    def replay(self) -> Iterator[LogRecord]:
        """Every record from the beginning of the topic up to its current end (high watermark)."""
        try:
            yield from self._log.replay()  # records that are not JSON objects are skipped there, with a warning
        except StateLogError as exc:
            raise StackError(str(exc)) from exc

    def append(self, records: Iterable[LogRecord]) -> None:
        """Produce records (idempotent, acks=all) and wait until the broker acknowledged all of them."""
        try:
            self._log.append(records)
        except StateLogError as exc:
            raise SchemaError(f"the registry could not write to {self.topic}: {exc}") from exc

    def close(self) -> None:
        """Flush and drop the producer."""
        self._log.close()
