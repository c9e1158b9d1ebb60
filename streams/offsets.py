"""The delivery loop's consumer positions: the partitions a member owns and what it committed of them.

At-least-once, a delivery's offsets are committed asynchronously once its outputs are acknowledged and its
side effects written (:mod:`streams.delivery`): the guarantee holds whenever the commit lands, and a commit
lost to a crash only means those records are read once more. A commit the broker refuses (typically a
rebalance moved the group to a new generation meanwhile) is made again when the loop is next idle; an idle
partition would otherwise keep its old position until its next batch. Revocation and shutdown commit
synchronously. Exactly-once, the offsets go into the transaction instead (:class:`streams.outbox.Outbox`) and
nothing is committed here.

The partitions owned are what the rebalance callbacks said (``consumer.assignment()`` asks librdkafka's own
thread and waits for its answer: a round trip per commit on the hot path). Consumer lag per partition is
observed after each commit, from the high watermarks the last fetch brought.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from prometheus_client import Counter, Gauge

COMMIT_FAILURES = Counter("tangram_processor_commit_failures_total",
                          "Offset commits the broker refused (those records are read again).", ["processor"])
LAG = Gauge("tangram_processor_consumer_lag_records", "Records not yet committed, per input partition.",
            ["processor", "topic", "partition"])

Partition = tuple[str, int]


class Offsets:
    """One loop's owned partitions and the newest position it handed to commit of each."""

    def __init__(self, consumer: Consumer, name: str, exactly_once: bool, log: logging.Logger):
        self.consumer, self.name, self.exactly_once, self.log = consumer, name, exactly_once, log
        self.owned: set[Partition] = set()
        self.committed: dict[Partition, int] = {}  # the newest position handed to commit, per partition
        self.refused = False  # the broker refused a commit: made again when the loop is next idle

    def assigned(self, partitions: list[TopicPartition]) -> None:
        self.owned.update((p.topic, p.partition) for p in partitions)

    def owned_of(self, positions: Iterable[TopicPartition]) -> list[TopicPartition]:
        """The last of ``positions`` for each partition still owned: a later batch's position of a partition
        supersedes an earlier one's, and one revoked meanwhile is its new owner's now."""
        owned = self.owned
        return list({(tp.topic, tp.partition): tp for tp in positions if (tp.topic, tp.partition) in owned}.values())

    def commit(self, positions: list[TopicPartition]) -> None:
        """Commit ``positions`` without waiting (at-least-once: their outputs are acknowledged already)."""
        if positions:
            self.consumer.commit(offsets=positions, asynchronous=True)
            for tp in positions:
                self.committed[(tp.topic, tp.partition)] = tp.offset

    def commit_again(self) -> None:
        """Commit again the newest positions of the partitions still owned, after the broker refused a commit."""
        self.refused = False
        if self.committed:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in self.committed.items()],
                                 asynchronous=True)

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """The consumer's commit callback (its configuration names it)."""
        if err is not None and err.code() != KafkaError._NO_OFFSET:
            self.refused = True  # made again when the loop is next idle
            COMMIT_FAILURES.labels(self.name).inc()
            self.log.warning("offset commit refused, made again when idle (a restart before then reads those "
                             "records again): %s", err.str())

    def commit_sync(self, partitions: Iterable[Partition] | None = None) -> None:
        """Commit the newest positions of ``partitions`` (default: all) and wait (revocation, shutdown)."""
        wanted = self.committed if partitions is None else partitions
        offsets = [TopicPartition(t, p, self.committed[(t, p)]) for t, p in wanted if (t, p) in self.committed]
        if not offsets or self.exactly_once:
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:  # e.g. the partitions already moved: their new owner reads them again
            self.log.warning("final commit of %d partition(s) failed, they will be read again: %s", len(offsets), exc)

    def release(self, partitions: list[TopicPartition]) -> None:
        """Revoked ``partitions``: their newest positions committed (waiting), then forgotten."""
        revoked = [(p.topic, p.partition) for p in partitions]
        self.commit_sync(revoked)
        for tp in revoked:
            self.committed.pop(tp, None)
            self.owned.discard(tp)

    def observe_lag(self, positions: list[TopicPartition]) -> None:
        """Consumer lag per partition after a commit, from the high watermarks the last fetch brought."""
        for tp in positions:
            try:
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            except KafkaException:
                continue
            if high >= 0:
                LAG.labels(self.name, tp.topic, str(tp.partition)).set(max(0, high - tp.offset))
