"""The rule processor's reads of the online store: the features its rules read that a prediction does not carry.

One read a batch, of the batch's distinct entities, narrowed to the fields the rules in effect read (a row is
read whole only when they read all of it), through the processor's Redis guard (:mod:`streams.resilience`:
the declared deadline, retries, circuit breaker). The read of a submitted batch runs in a reader thread of its
own, in order, so that Redis answers while the delivery loop delivers the batch before.

An entity's first row may come after its first prediction (the feature stage writes a window's row once the
broker acknowledged its whole batch of windows): :meth:`OnlineReads.wait_for_rows` waits for it, up to
``online_wait_ms`` an entity.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis
from prometheus_client import Counter

from streams.errors import ServiceUnavailableError
from streams.features.layout import FeastLayout
from streams.features.online import OnlineRows, read_online_rows
from streams.resilience import Guard
from streams.rules.engine import CompiledRule

log = logging.getLogger("tangram.rules")

ROW_WAITS = Counter("tangram_rules_online_row_waits_total", "Batches that waited for an entity's first online row, by "
                    "outcome (landed, waited_out).", ["processor", "outcome"])

ROW_POLL_S = 0.005  # how often a batch waiting for online rows reads the missing ones again
_ROWLESS_MAX = 100_000  # entities remembered as waited out for their first online row


class OnlineReads:
    """The online-store reads of one rule processor (``layout``: the feature stage's rows in Feast's layout)."""

    def __init__(self, processor: str, redis_url: str, layout: FeastLayout, carried: frozenset[str],
                 guard: Guard | None = None, wait_ms: int = 0):
        self.processor, self.layout, self.guard, self.wait_ms = processor, layout, guard, wait_ms
        self.carried = carried  # what a prediction carries itself: never read from the store
        timeout_s = guard.timeout_s if guard is not None else 5.0
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._narrowed: dict[tuple[CompiledRule, ...], FeastLayout | None] = {}  # rules → the fields they read
        self._reader: ThreadPoolExecutor | None = None  # the reads of submitted batches, in order
        self.rowless: dict[str, float] = {}  # entity → when a batch first found it without a row
        self.clock, self.sleep = time.monotonic, time.sleep  # (replaced in tests)

    # -- lifecycle ---------------------------------------------------------------------
    def setup(self) -> None:
        try:
            self.call(self.redis.ping)
        except ServiceUnavailableError as exc:  # the first batch that needs it waits for it (backpressure)
            log.warning("%s: online store not reachable at start: %s", self.processor, exc)

    def ready(self) -> bool:
        """After a backpressure: whether Redis answers (no call while its breaker is open)."""
        return self.guard is None or self.guard.probe(self.redis.ping)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        self.redis.close()

    def call(self, call: Callable[..., Any], *args: Any) -> Any:
        """One Redis call through the processor's guard (deadline, retries, breaker)."""
        return self.guard.call(call, *args) if self.guard is not None else call(*args)

    # -- reads -------------------------------------------------------------------------
    def narrowed(self, rules: tuple[CompiledRule, ...]) -> FeastLayout | None:
        """The layout narrowed to the features ``rules`` read that a prediction does not carry (None: nothing to
        read). A row is read whole only when the rules read all of it."""
        if rules not in self._narrowed:
            layout = self.layout
            needed = {s for r in rules for s in r.symbols} - self.carried
            if not needed & set(layout.fields):
                self._narrowed[rules] = None
            else:
                self._narrowed[rules] = dataclasses.replace(
                    layout, int_fields=tuple(f for f in layout.int_fields if f in needed or f == layout.event_time_field),
                    double_fields=tuple(f for f in layout.double_fields if f in needed))
        return self._narrowed[rules]

    def forget(self) -> None:
        """The rule set changed: the narrowed layouts of the old one are not asked for again."""
        self._narrowed.clear()

    def read(self, entities: list[str], rules: tuple[CompiledRule, ...]) -> Mapping[str, dict]:
        """The rows of ``entities`` (one read) narrowed to what ``rules`` read; ``{}`` when they read nothing."""
        narrowed = self.narrowed(rules)
        if not entities or narrowed is None:
            return {}
        return self.call(read_online_rows, self.redis, list(dict.fromkeys(entities)), narrowed)

    def submit(self, read: Callable[[list[str]], Mapping[str, dict]], entities: list[str]) -> Future:
        """``read(entities)`` in the reader thread (after the reads submitted before)."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.processor}-online")
        return self._reader.submit(read, entities)

    def wait_for_rows(self, online: Mapping[str, dict],
                      read: Callable[[list[str]], Mapping[str, dict]]) -> Mapping[str, dict]:
        """The batch's rows once every entity it decides on has one, or has waited ``wait_ms`` for it from the
        first batch that found it without (a device's first window; a partition led by a failing broker, where a
        chaos run dead-lettered the first predictions of two devices). Only the missing entities are read again
        (``read``), every ``ROW_POLL_S``: the batch waits no longer than the row takes to land. Past the wait it
        is decided without them (``rule_missing_input``), and so are later batches' predictions of those
        entities until a row of theirs is seen. Nothing changes state before this returns; Redis failing
        meanwhile is backpressure, as for the first read."""
        if not isinstance(online, OnlineRows) or not self.wait_ms:
            return online
        rowless, since = online.unknown(), self.rowless
        if since:
            missing = set(rowless)
            for entity in [e for e in online.entities if e in since and e not in missing]:
                del since[entity]  # its row came
        if not rowless:
            return online
        now, wait = self.clock(), self.wait_ms / 1000
        for entity in rowless:
            since.setdefault(entity, now)
        waited = False
        while waiting := [e for e in rowless if now - since[e] < wait]:
            self.sleep(min(ROW_POLL_S, min(since[e] for e in waiting) + wait - now))
            again = read(waiting)
            online = online.updated(again)
            landed = set(waiting).difference(again.unknown())
            rowless = [e for e in rowless if e not in landed]
            for entity in landed:
                del since[entity]
            now, waited = self.clock(), True
        # the rest waited out: decided without them, and later batches do not wait for them again until a row lands
        while len(since) > _ROWLESS_MAX:
            del since[next(iter(since))]  # the longest remembered
        if waited:
            ROW_WAITS.labels(self.processor, "waited_out" if rowless else "landed").inc()
        return online


__all__ = ["ROW_POLL_S", "OnlineReads"]
