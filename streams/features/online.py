"""The online store: Feast's Redis store, written by the engines and read by the rules, without Feast.

Every engine writes the newest row of each entity straight into Feast's Redis layout
(``streams.features.layout``: one hash per entity and Feast project, murmur3 field names,
``feast.types.Value`` values, ``_ts:<view>``, the key TTL), so Feast's own
``get_online_features`` serves what the engines wrote, and the lookups here read the same
bytes. Writes keep Feast's rule: a row whose ``window_end`` is not newer than the stored one
is skipped, so a replayed window leaves the same state. A writer given a ``guard`` (the
processor's Redis calls in :mod:`streams.resilience`: deadline, retries, circuit breaker) raises
:class:`~streams.errors.ServiceUnavailableError` when Redis is down, and the delivery loop pauses
and tries ``flush`` again: it does not commit offsets until ``flush`` returned. Without one (the
Faust job's own loop) the writer waits and retries, bounded by ``retry_s``.

Reads:

- ``read_online_features(client, entity_ids, layout)``: Feast's ``HMGET`` of every field of the
  view for each entity, all in one command (``HMGET_MANY``, a Lua script: packing one 33-argument
  ``HMGET`` per key cost more in Python than Redis serving it); the rule processor's lookup, once
  per micro-batch;
- ``OnlineLookup``: an asyncio lookup for servers with many concurrent callers: the lookups
  made while a round trip is in flight are coalesced into the next command (DataLoader style),
  so a burst of single-key calls costs a few round trips, not one each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import redis
import redis.asyncio

from streams.errors import DeliveryError, ServiceUnavailableError
from streams.features.layout import (
    HMGET_MANY,
    HMGET_MANY_SHA,
    HSET_NEWER,
    HSET_NEWER_SHA,
    FeastLayout,
)

if TYPE_CHECKING:  # the Flink job's environment imports this module without the resilience layer's libraries
    from streams.resilience import Guard

log = logging.getLogger("tangram.features.online")

T = TypeVar("T")

#: Rows per online-store write command (see ``OnlineWriter.flush``).
WRITE_CHUNK = 256

#: A staged row: its event time, and the row (``OnlineWriter.stage``) or its packed values (``stage_packed``).
_Staged = tuple[int, "Mapping | bytes"]


class OnlineWriter:
    """Stages output rows and writes them to Feast's Redis layout on ``flush``, retrying while Redis is unreachable."""

    def __init__(self, redis_url: str, layout: FeastLayout, *, retry_s: float = 300.0, timeout_s: float = 5.0,
                 guard: Guard | None = None, write_chunk: int = WRITE_CHUNK):
        self.layout = layout
        self.write_chunk = write_chunk
        self.retry_s = retry_s
        self.guard = guard
        timeout_s = guard.timeout_s if guard is not None else timeout_s
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._pending: dict[str, _Staged] = {}  # entity → its newest row not yet written, and its event time
        # the rows and progress of a write that failed, taken again by the next flush
        self._failed: tuple[dict[str, _Staged], tuple[bytes, dict[bytes, bytes]] | None] = ({}, None)
        self._writer: ThreadPoolExecutor | None = None  # flush_async's thread, started by its first call
        self.retries = 0
        self.written = 0
        self.skipped = 0  # rows not newer than the stored one (Feast's rule)

    def setup(self) -> None:
        try:
            self._retrying("ping", self.redis.ping)
        except ServiceUnavailableError as exc:  # the first batch waits for it (backpressure), nothing is lost
            log.warning("online store not reachable at start: %s", exc)

    def ready(self) -> bool:
        """Whether Redis answers (through the guard's breaker: no call while it is open)."""
        return self.guard.probe(self.redis.ping) if self.guard is not None else True

    def stage(self, row: Mapping) -> None:
        """Stage ``row`` to be written at the next flush, unless a newer row of its entity is staged."""
        self._stage(row[self.layout.join_key], self.layout.event_time_ms(row), row)

    def stage_packed(self, entities: Sequence[str], event_ms: Sequence[int], cells: Sequence[bytes]) -> None:
        """:meth:`stage` of rows already packed (``FeastLayout.pack_columns``): a batch of windows, no dict each."""
        for entity, at, packed in zip(entities, event_ms, cells):
            self._stage(entity, at, packed)

    def _stage(self, entity: str, event_ms: int, row: Mapping | bytes) -> None:
        current = self._pending.get(entity)
        if current is None or event_ms >= current[0]:
            self._pending[entity] = (event_ms, row)

    def flush(self, progress: tuple[bytes, dict[bytes, bytes]] | None = None) -> None:
        """Write the staged rows newer than what Redis holds, Feast's rule checked inside Redis: one round trip
        of commands of up to ``write_chunk`` rows each.

        A Lua script runs alone in Redis: the windows of a whole fleet closing at once (thousands of rows) in one
        script would hold every reader (the rules' online reads) for tens of milliseconds; commands of a few
        hundred rows let the readers in between. ``progress``: a hash key and fields (an engine's record of how
        far it got, see ``streams.features.engine``) written by the last command, so that it never lands
        before the rows it accounts for.
        """
        if (taken := self._take(progress)) is not None:
            self._write(*taken)

    def flush_async(self, progress: tuple[bytes, dict[bytes, bytes]] | None = None) -> Future | None:
        """:meth:`flush` in the writer's own thread: the returned future is done when the rows and ``progress``
        are written (its ``result()`` raises what ``flush`` would); None when there is nothing to write.

        The delivery loop reads and processes the next batch meanwhile, and commits this batch's offsets once
        the future is done (``Processor.flush``). One write at a time: the caller waits for the future before it
        calls again. A write that failed gives its rows back at the next call (a row staged since, of a newer
        window, supersedes its entity's), so a retry writes them.
        """
        taken = self._take(progress)
        if taken is None:
            return None
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="online-writer")
        return self._writer.submit(self._write, *taken)

    def _take(self, progress: tuple[bytes, dict[bytes, bytes]] | None
              ) -> tuple[dict[str, _Staged], tuple[bytes, dict[bytes, bytes]] | None] | None:
        """The staged rows and the progress, handed over for one write (None: nothing to write). What a write
        that failed held goes again: its rows (where no newer one of their entity is staged since) and its
        progress fields (where the new progress does not move them on)."""
        failed_rows, failed_progress = self._failed
        self._failed = ({}, None)
        for entity, (event_ms, row) in failed_rows.items():
            self._stage(entity, event_ms, row)
        if failed_progress is not None:
            key, fields = failed_progress
            progress = (key, {**fields, **(progress[1] if progress else {})})
        if not self._pending and not (progress and progress[1]):
            return None
        rows, self._pending = self._pending, {}
        return rows, progress

    def _write(self, staged: dict[str, _Staged], progress: tuple[bytes, dict[bytes, bytes]] | None) -> None:
        layout = self.layout
        entities, rows = list(staged), list(staged.values())
        head = [layout.key_ttl_s or 0, len(layout.read_fields)]
        commands: list[tuple[list, list]] = []
        dicts = [row for _, row in rows if not isinstance(row, bytes)]  # staged one by one: packed all at once
        packed = iter(layout.pack_rows(dicts) if dicts else ())
        cells = [row if isinstance(row, bytes) else next(packed) for _, row in rows]
        row_keys = layout.keys(entities)
        n = self.write_chunk
        for at in range(0, len(rows), n) or (0,):  # no rows: one command for the progress alone
            chunk = rows[at:at + n]
            args: list = [*head, len(chunk), *layout.read_fields]
            for (event_ms, _), packed_row in zip(chunk, cells[at:at + n]):
                args += (event_ms, packed_row)
            commands.append((row_keys[at:at + n], args))
        if progress and progress[1]:
            keys, args = commands[-1]
            keys.append(progress[0])
            for name, value in progress[1].items():
                args += (name, value)

        def send() -> int:
            pipe = self.redis.pipeline(transaction=False)
            for keys, args in commands:
                pipe.evalsha(HSET_NEWER_SHA, len(keys), *keys, *args)
            return sum(int(n) for n in pipe.execute())

        def write() -> int:
            try:
                return send()
            except redis.exceptions.NoScriptError:  # a fresh or restarted Redis: load the script once
                self.redis.script_load(HSET_NEWER)  # (every command of the round trip was refused)
                return send()

        try:
            written = self._retrying("write", write)
        except BaseException:
            self._failed = (staged, progress)  # taken again by the next flush
            raise
        self.written += written
        self.skipped += len(rows) - written

    def read_hash(self, key: bytes, fields: list[bytes]) -> list[bytes | None]:
        """``HMGET key fields`` (retried while Redis is down, as writes are)."""
        if not fields:
            return []
        return self._retrying("read", lambda: self.redis.hmget(key, fields))

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        if self.guard is not None:
            try:
                return self.guard.call(call)
            except ServiceUnavailableError:
                self.retries += 1
                raise
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            try:
                return call()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise DeliveryError(f"online store {what} failed for {self.retry_s:.0f}s ({exc}); "
                                        "offsets not committed: start Redis and restart the processor") from exc
                self.retries += 1
                log.warning("online store %s failed (%s); retrying in %.1fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.redis.close()


def read_online_features(client: redis.Redis, entity_ids: list[str], layout: FeastLayout) -> list[dict]:
    """The newest row of each entity in the online store (``{}`` when unknown), in one command."""
    return [layout.decode_row(values) for values in _hmget_many(client, entity_ids, layout)]


def read_online_rows(client: redis.Redis, entity_ids: list[str], layout: FeastLayout) -> OnlineRows:
    """:func:`read_online_features` of distinct entities, each row decoded only when it is asked for."""
    return OnlineRows(layout, entity_ids, _hmget_many(client, entity_ids, layout))


def _hmget_many(client: redis.Redis, entity_ids: list[str], layout: FeastLayout) -> list[list[bytes | None]]:
    """Feast's ``HMGET`` of ``layout.read_fields`` for each entity, in one command (the ``HMGET_MANY`` script)."""
    if not entity_ids:
        return []
    keys = layout.keys(entity_ids)
    try:
        return client.evalsha(HMGET_MANY_SHA, len(keys), *keys, *layout.read_fields)
    except redis.exceptions.NoScriptError:  # a fresh or restarted Redis: load the script once
        client.script_load(HMGET_MANY)
        return client.evalsha(HMGET_MANY_SHA, len(keys), *keys, *layout.read_fields)


class OnlineRows(Mapping[str, dict]):
    """The rows of a batch of distinct entities read from the online store: a mapping entity → row (``{}`` when
    unknown), each decoded the first time it is asked for, and a double field of them all as one array."""

    def __init__(self, layout: FeastLayout, entity_ids: list[str], replies: list[list[bytes | None]]):
        self.layout, self.entities, self._replies = layout, entity_ids, replies
        self._index = dict(zip(entity_ids, range(len(entity_ids))))
        self._rows: dict[str, dict] = {}

    def __getitem__(self, entity: str) -> dict:
        row = self._rows.get(entity)
        if row is None:
            row = self._rows[entity] = self.layout.decode_row(self._replies[self._index[entity]])
        return row

    def __iter__(self) -> Iterator[str]:
        return iter(self.entities)

    def __len__(self) -> int:
        return len(self.entities)

    def __contains__(self, entity: object) -> bool:
        return entity in self._index

    def unknown(self) -> list[str]:
        """The entities read that have no row in the view (their ``{}``), without decoding the others."""
        has_row = self.layout.has_row
        return [e for e, values in zip(self.entities, self._replies) if not has_row(values)]

    def updated(self, newer: "OnlineRows") -> "OnlineRows":
        """These rows, with ``newer``'s (a later read of some of these entities) for each entity it found a row of."""
        replies, has_row = list(self._replies), self.layout.has_row
        for entity, values in zip(newer.entities, newer._replies):
            if has_row(values):
                replies[self._index[entity]] = values
        return OnlineRows(self.layout, self.entities, replies)

    def doubles(self, name: str, entities: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Double field ``name`` of each of ``entities`` (all read here) and where it is a plain double."""
        values, valid = self.layout.decode_doubles(self._replies, name)
        index = np.fromiter((self._index[e] for e in entities), dtype=np.int64, count=len(entities))
        return values[index], valid[index]


class OnlineLookup:
    """Asyncio lookups of the online store that coalesce concurrent callers into shared round trips.

    ``await lookup.get(ids)`` queues the ids; a flusher sends what is queued as one command
    (``HMGET_MANY``), at most ``max_in_flight`` commands at a time and ``max_keys`` keys a command
    (a Lua script runs alone in Redis: a bounded one keeps everyone else's waits short), so under
    load each round trip carries the lookups that arrived during the previous one (DataLoader
    style). Every round trip has the socket deadline ``timeout_s``; a failed one fails only the
    calls it carried. It does not shed load: past its capacity calls queue, and their latency shows it.
    """

    def __init__(self, redis_url: str, layout: FeastLayout, *, max_in_flight: int = 2, max_keys: int = 512,
                 timeout_s: float = 1.0):
        self.layout = layout
        self.max_in_flight = max_in_flight
        self.max_keys = max_keys
        self.redis = redis.asyncio.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                                  socket_connect_timeout=timeout_s)
        self._queue: deque[tuple[list[str], asyncio.Future]] = deque()
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._in_flight = 0
        self._scheduled = False
        self.round_trips = 0

    def get(self, entity_ids: list[str]) -> asyncio.Future:
        """Awaitable: the newest row of each entity (``{}`` when unknown)."""
        future = asyncio.get_running_loop().create_future()
        if not entity_ids:
            future.set_result([])
            return future
        self._queue.append((entity_ids, future))
        if not self._scheduled and self._in_flight < self.max_in_flight:
            self._scheduled = True
            future.get_loop().call_soon(self._flush)  # after the callers of this loop tick queued theirs
        return future

    def _flush(self) -> None:
        """Send the queued calls, ``max_keys`` keys a command at most (a script runs alone in Redis)."""
        self._scheduled = False
        queue = self._queue
        while queue and self._in_flight < self.max_in_flight:
            batch = [queue.popleft()]
            keys = len(batch[0][0])
            while queue and keys + len(queue[0][0]) <= self.max_keys:
                keys += len(queue[0][0])
                batch.append(queue.popleft())
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._round_trip(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _round_trip(self, batch: list[tuple[list[str], asyncio.Future]]) -> None:
        layout = self.layout
        key = layout.key
        keys = [key(entity) for ids, _ in batch for entity in ids]
        try:
            try:
                replies = await self.redis.evalsha(HMGET_MANY_SHA, len(keys), *keys, *layout.read_fields)
            except redis.exceptions.NoScriptError:
                await self.redis.script_load(HMGET_MANY)
                replies = await self.redis.evalsha(HMGET_MANY_SHA, len(keys), *keys, *layout.read_fields)
            self.round_trips += 1
            at = 0
            decode = layout.decode_row
            for ids, future in batch:
                if not future.done():
                    future.set_result([decode(v) for v in replies[at:at + len(ids)]])
                at += len(ids)
        except Exception as exc:  # noqa: BLE001 - handed to every caller of this round trip
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        finally:
            self._in_flight -= 1
            if self._queue and not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)

    async def close(self) -> None:
        await self.redis.aclose()
