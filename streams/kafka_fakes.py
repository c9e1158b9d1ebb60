"""Fakes of the Kafka clients, for unit tests of the delivery loop without a broker.

``Runner(processor, config, consumer=FakeConsumer(...), producer=FakeProducer())`` runs the real
loop (natural batching, commits after acks, backpressure, rebalances) against them. The consumer
serves each partition's log in offset order on a virtual clock, the way librdkafka's
``consume(n, timeout)`` does: it returns as soon as ``n`` messages are there, or when ``timeout``
has passed with fewer. A test schedules when each record arrives, and when partitions are revoked,
and reads on the clock when each batch was taken: timing is asserted exactly, nothing sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from confluent_kafka import KafkaError, TopicPartition


class VirtualClock:
    """Seconds since the test started; only the fake consumer moves it (by waiting)."""

    def __init__(self) -> None:
        self.now = 0.0


class FakeMessage:
    """What ``Consumer.consume`` returns, for one record (the accessors the delivery loop calls)."""

    __slots__ = ("_topic", "_partition", "_offset", "_key", "_value", "_headers", "_timestamp_ms")

    def __init__(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                 headers: list[tuple[str, bytes]] | None, timestamp_ms: int):
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._headers, self._timestamp_ms = key, value, headers, timestamp_ms

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return 1, self._timestamp_ms  # TIMESTAMP_CREATE_TIME

    def error(self) -> None:
        return None


@dataclass
class _Partition:
    log: list[tuple[float, FakeMessage]] = field(default_factory=list)  # (arrival, message), in offset order
    position: int = 0
    paused: bool = False


class FakeConsumer:
    """A consumer of the partitions it is built with, all assigned at the first ``consume``."""

    def __init__(self, partitions: list[tuple[str, int]], clock: VirtualClock | None = None):
        self.clock = clock or VirtualClock()
        self._partitions = {tp: _Partition() for tp in partitions}
        self._assigned: list[tuple[str, int]] = []
        self._revocations: list[tuple[float, list[tuple[str, int]]]] = []
        self._callbacks: dict[str, Callable] = {}
        #: ``(num_messages, timeout_s, returned)`` of every ``consume`` call, in order.
        self.calls: list[tuple[int, float, int]] = []
        #: The newest offset committed per partition.
        self.committed: dict[tuple[str, int], int] = {}
        #: Commits the broker refuses from now on (a rebalance moved the group to a new generation), and the
        #: ``on_commit`` callback of the consumer's configuration that hears of it.
        self.refuse_commits = 0
        self.on_commit: Callable[[KafkaError | None, list[TopicPartition]], None] | None = None
        self.closed = False

    # -- what a test schedules ----------------------------------------------------------------
    def arrive(self, topic: str, partition: int, values: list[bytes], at: float = 0.0,
               key: bytes | None = b"k", headers: list[tuple[str, bytes]] | None = None) -> None:
        """``values`` become readable on ``topic[partition]`` at virtual time ``at`` (seconds)."""
        part = self._partitions[(topic, partition)]
        for value in values:
            offset = len(part.log)
            part.log.append((at, FakeMessage(topic, partition, offset, key, value, headers, int(at * 1000))))

    def revoke_at(self, at: float, partitions: list[tuple[str, int]]) -> None:
        """The group takes ``partitions`` away at virtual time ``at`` (served inside a ``consume`` call)."""
        self._revocations.append((at, partitions))
        self._revocations.sort(key=lambda r: r[0])

    # -- the Consumer API the delivery loop uses -------------------------------------------------
    def subscribe(self, topics: list[str], on_assign: Callable, on_revoke: Callable, on_lost: Callable) -> None:
        self._callbacks = {"assign": on_assign, "revoke": on_revoke}

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        if not self._assigned:
            self._assigned = list(self._partitions)
            self._callbacks["assign"](self, [TopicPartition(t, p) for t, p in self._assigned])
        deadline = self.clock.now + timeout
        out: list[FakeMessage] = []
        while True:
            if revoked := self._serve_revocations():  # like librdkafka's version barrier inside one call
                out = [m for m in out if (m.topic(), m.partition()) not in revoked]
            out.extend(self._ready(num_messages - len(out)))
            if len(out) >= num_messages:
                break
            upcoming = self._next_event()
            if upcoming is None or upcoming > deadline:
                self.clock.now = max(self.clock.now, deadline)
                break
            self.clock.now = max(self.clock.now, upcoming)
        self.calls.append((num_messages, timeout, len(out)))
        return out

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in self._assigned]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        if self.refuse_commits:
            self.refuse_commits -= 1
            if self.on_commit is not None:
                self.on_commit(KafkaError(KafkaError.ILLEGAL_GENERATION), offsets)
            return
        for tp in offsets:
            self.committed[(tp.topic, tp.partition)] = tp.offset

    def seek(self, tp: TopicPartition) -> None:
        self._partitions[(tp.topic, tp.partition)].position = tp.offset

    def pause(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._partitions[(tp.topic, tp.partition)].paused = True

    def resume(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._partitions[(tp.topic, tp.partition)].paused = False

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        return 0, len(self._partitions[(tp.topic, tp.partition)].log)

    def consumer_group_metadata(self) -> object:
        return object()

    def close(self) -> None:
        self.closed = True

    # -- the model -------------------------------------------------------------------------------
    def _ready(self, wanted: int) -> list[FakeMessage]:
        """Up to ``wanted`` messages that have arrived, partition by partition, in offset order."""
        out: list[FakeMessage] = []
        for tp in self._assigned:
            part = self._partitions[tp]
            while len(out) < wanted and not part.paused and part.position < len(part.log):
                arrived, message = part.log[part.position]
                if arrived > self.clock.now:
                    break
                out.append(message)
                part.position += 1
        return out

    def _next_event(self) -> float | None:
        """When the next record arrives or the next revocation happens, after now."""
        times = [part.log[part.position][0] for tp in self._assigned
                 if not (part := self._partitions[tp]).paused and part.position < len(part.log)]
        times += [at for at, _ in self._revocations]
        later = [t for t in times if t > self.clock.now]
        return min(later) if later else None

    def _serve_revocations(self) -> set[tuple[str, int]]:
        """Run the revocations due by now (the loop's callback); returns the partitions revoked."""
        revoked: set[tuple[str, int]] = set()
        while self._revocations and self._revocations[0][0] <= self.clock.now:
            _, partitions = self._revocations.pop(0)
            self._assigned = [tp for tp in self._assigned if tp not in partitions]
            self._callbacks["revoke"](self, [TopicPartition(t, p) for t, p in partitions])
            revoked.update(partitions)
        return revoked


class FakeProducer:
    """A producer whose every record is acknowledged at ``flush`` (transactions recorded, not enforced)."""

    def __init__(self) -> None:
        self._queued: list[tuple[str, bytes | None, bytes | str | None]] = []
        #: ``(topic, value, key)`` of every acknowledged record, in order.
        self.acked: list[tuple[str, bytes | None, bytes | str | None]] = []
        #: Transaction calls in order: ``begin``, ``offsets``, ``commit``, ``abort``.
        self.transactions: list[str] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | str | None = None,
                headers: object = None) -> None:
        self._queued.append((topic, value, key))

    def flush(self, timeout: float | None = None) -> int:
        self.acked.extend(self._queued)
        self._queued.clear()
        return 0

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def init_transactions(self, timeout: float | None = None) -> None:
        self.transactions.clear()

    def begin_transaction(self) -> None:
        self.transactions.append("begin")

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], metadata: object,
                                    timeout: float | None = None) -> None:
        self.transactions.append("offsets")

    def commit_transaction(self, timeout: float | None = None) -> None:
        self.flush()
        self.transactions.append("commit")

    def abort_transaction(self, timeout: float | None = None) -> None:
        self._queued.clear()
        self.transactions.append("abort")
