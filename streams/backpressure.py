"""Backpressure: a delivery loop's input paused while its processor cannot make progress.

A processor that cannot make progress now (a service it needs is slow or down) raises
:class:`~streams.errors.BackpressureError`, from ``process`` or from ``flush``. Nothing is lost
and the group never rebalances: every assigned partition is paused and the loop keeps polling
(polls return nothing while paused, so ``max.poll.interval.ms`` is never exceeded) while it backs
off exponentially (``backoff_initial_s`` doubling up to ``backoff_max_s``) and asks the processor
whether it is ``ready()``; then it resumes. A batch put back is read again from its first offset in
each partition; side effects that failed are written again before their batches' offsets are
committed (exactly-once: within 80 % of the open transaction's timeout, else the processor stops
and a restart rebuilds from the committed offsets).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, Message, TopicPartition
from prometheus_client import Counter, Gauge

from streams.errors import BackpressureError, DeliveryError

if TYPE_CHECKING:
    from streams.delivery import Processor, Record, RunnerConfig

BACKPRESSURE = Counter(
    "tangram_processor_backpressure_total", "Batches put back because the processor could not make progress.",
    ["processor"],
)
PAUSED_SECONDS = Counter(
    "tangram_processor_paused_seconds_total", "Time spent with every partition paused (backpressure).", ["processor"]
)
PAUSED = Gauge("tangram_processor_paused", "1 while the processor's partitions are paused (backpressure).", ["processor"])


def first_offsets(records: Iterable["Record"]) -> dict[tuple[str, int], int]:
    """The first offset of each partition among ``records``."""
    first: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r.topic, r.partition)
        first[key] = min(first.get(key, r.offset), r.offset)
    return first


class Backpressure:
    """Pauses, backs off and resumes a loop's consumer for its processor; counts the times and the seconds."""

    def __init__(self, processor: "Processor", consumer: Consumer, config: "RunnerConfig", stopped: threading.Event,
                 usable: Callable[[Message], bool]):
        """``usable`` tells a message from a consumer error (raising on a fatal one)."""
        self.processor, self.consumer, self.config = processor, consumer, config
        self.stopped = stopped
        self.usable = usable
        self.log = logging.getLogger(f"tangram.processor.{processor.name}")
        self._backoff_s = config.backoff_initial_s
        #: Batches put back or side effects retried, and seconds spent paused.
        self.events = 0
        self.paused_s = 0.0

    def progressed(self) -> None:
        """The processor made progress: the next back-off starts from ``backoff_initial_s`` again."""
        self._backoff_s = self.config.backoff_initial_s

    def put_back(self, records: list["Record"], reason: BackpressureError) -> None:
        """Put ``records`` back, pause, poll while backing off until the processor is ready, resume.

        Nothing of the batch was produced or committed. Each partition of the batch is sought
        back to the batch's first offset in it, so that after ``resume`` the same records are
        read again. Records a poll returns while paused (a partition assigned meanwhile) are put
        back the same way. Polling goes on throughout, so the member stays in its group.
        """
        name = self.processor.name
        first = first_offsets(records)
        started = self._pause()
        self.rewind(first)
        delay = self._next_delay()
        self.log.warning("%s cannot make progress, %d records put back (%s); paused, retrying in %.2fs: %s",
                         name, len(records), ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(first.items())),
                         delay, reason)
        try:
            while not self.stopped.is_set():
                self._poll_paused(time.monotonic() + delay, first)
                if self.stopped.is_set() or self.processor.ready():
                    break
                delay = self._next_delay()
                self.log.info("%s still not ready after %.1fs paused; next check in %.2fs",
                              name, time.monotonic() - started, delay)
        finally:
            paused = self._resume(started)
        self.log.info("%s resumed after %.2fs paused", name, paused)

    def write_side_effects(self, reason: BackpressureError, flush: Callable[[], None]) -> None:
        """The side effects failed with ``reason``: pause, back off and ``flush`` again until they are written.

        The batches' outputs are acknowledged already; their offsets wait for the side effects, so nothing is
        lost and nothing is read twice. ``DeliveryError`` when the loop is stopped meanwhile, or, exactly-once,
        past 80 % of the transaction's timeout (the caller aborts the transaction)."""
        name, cfg = self.processor.name, self.config
        started = self._pause()
        deadline = started + 0.8 * cfg.transaction_timeout_s if cfg.exactly_once else None
        delay = cfg.backoff_initial_s
        self.log.warning("%s: side effects not written, offsets held; paused, retrying in %.2fs: %s",
                         name, delay, reason)
        try:
            while True:
                until = time.monotonic() + delay
                self._poll_paused(until if deadline is None else min(until, deadline), {})
                if self.stopped.is_set():
                    raise DeliveryError(f"{name}: stopped while side effects were not written ({reason}); "
                                        "offsets not committed, the batch is read again after a restart")
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeliveryError(f"{name}: side effects not written within the transaction's "
                                        f"{cfg.transaction_timeout_s:g}s ({reason}); transaction aborted, "
                                        "offsets not committed: the processor stops and a restart rebuilds")
                if self.processor.ready():
                    try:
                        flush()
                        break
                    except BackpressureError as exc:
                        reason = exc
                delay = min(delay * 2, cfg.backoff_max_s)
                self.log.info("%s: side effects still not written after %.1fs paused; next try in %.2fs: %s",
                              name, time.monotonic() - started, delay, reason)
        finally:
            self._resume(started)
        self.log.info("%s: side effects written after %.2fs paused; resumed", name, time.monotonic() - started)

    def rewind(self, first: Mapping[tuple[str, int], int]) -> None:
        """Seek each partition back to ``first[partition]``; a partition no longer assigned is skipped."""
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        for (topic, partition), offset in first.items():
            if (topic, partition) not in assigned:
                continue  # revoked meanwhile: its new owner reads from the committed offset
            # A failed seek raises: the processor stops without committing, a restart re-reads.
            self.consumer.seek(TopicPartition(topic, partition, offset))

    def _next_delay(self) -> float:
        delay = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.config.backoff_max_s)
        return delay

    def _pause(self) -> float:
        """Pause every assigned partition; returns when (monotonic)."""
        self.events += 1
        BACKPRESSURE.labels(self.processor.name).inc()
        self.consumer.pause(self.consumer.assignment())
        PAUSED.labels(self.processor.name).set(1)
        return time.monotonic()

    def _resume(self, started: float) -> float:
        """Resume every assigned partition; returns the seconds paused since ``started``."""
        paused = time.monotonic() - started
        self.paused_s += paused
        PAUSED_SECONDS.labels(self.processor.name).inc(paused)
        PAUSED.labels(self.processor.name).set(0)
        self.consumer.resume(self.consumer.assignment())
        return paused

    def _poll_paused(self, until: float, first: dict[tuple[str, int], int]) -> None:
        """Poll until ``until`` (monotonic) with every partition paused; put back anything a poll returns.

        ``first`` is where each partition was sought back to; a message at or past it will be read
        again anyway, one before it (a partition assigned while paused) moves the rewind point back.
        """
        while (left := until - time.monotonic()) > 0 and not self.stopped.is_set():
            messages = self.consumer.consume(self.config.batch_size, min(left, 0.2))
            stray: dict[tuple[str, int], int] = {}
            for m in messages:
                if not self.usable(m):
                    continue
                key = (m.topic(), m.partition())
                if m.offset() < first.get(key, m.offset() + 1):
                    stray[key] = min(stray.get(key, m.offset()), m.offset())
            if stray:
                first.update(stray)
                self.consumer.pause([TopicPartition(t, p) for t, p in stray])
                self.rewind(stray)


__all__ = ["Backpressure", "first_offsets"]
