"""The online store: the latest window of each entity in Redis, written by the engines, read by rules.

Layout: one hash per entity, ``<prefix>:<entity id>``, holding the output row of its newest
window (``window_start``, ``window_end``, ``count`` and every feature), with the feature
set's TTL. Writes are overwrites keyed by entity, so a replayed window leaves the same
state. When Redis is down the writer waits and retries (bounded by ``retry_s``) instead
of losing the rows: the delivery loop does not commit offsets until ``flush`` returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from streams.errors import DeliveryError
from streams.features.spec import FeatureSet

log = logging.getLogger("tangram.features.online")

T = TypeVar("T")


def online_prefix(app: str, processor: str) -> str:
    """Where a feature processor keeps its online features in Redis."""
    return f"tangram:{app}:{processor}"


def online_key(prefix: str, entity_id: str) -> str:
    return f"{prefix}:{entity_id}"


class OnlineWriter:
    """Stages output rows and writes them to Redis on ``flush``, retrying while Redis is unreachable."""

    def __init__(self, redis_url: str, prefix: str, fs: FeatureSet, *, retry_s: float = 300.0,
                 timeout_s: float = 5.0):
        self.prefix = prefix
        self.fs = fs
        self.retry_s = retry_s
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._pending: dict[str, dict] = {}  # entity → newest row not yet written
        self.retries = 0

    def setup(self) -> None:
        self._retrying("ping", self.redis.ping)

    def stage(self, row: dict) -> None:
        entity = row[self.fs.entity.join_key]
        current = self._pending.get(entity)
        if current is None or row["window_end"] >= current["window_end"]:
            self._pending[entity] = row

    def emitted_ends(self, entities: list[str]) -> list[int]:
        """The ``window_end`` stored for each entity (-1 when none): its windows up to there were emitted."""
        def read() -> list:
            pipe = self.redis.pipeline(transaction=False)
            for entity in entities:
                pipe.hget(online_key(self.prefix, entity), "window_end")
            return pipe.execute()
        return [int(end) if end is not None else -1 for end in self._retrying("read", read)]

    def flush(self) -> None:
        if not self._pending:
            return
        key_field, ttl = self.fs.entity.join_key, self.fs.online.ttl_s

        def write() -> None:
            pipe = self.redis.pipeline(transaction=False)
            for entity, row in self._pending.items():
                key = online_key(self.prefix, entity)
                pipe.hset(key, mapping={k: v for k, v in row.items() if k != key_field})
                pipe.expire(key, ttl)
            pipe.execute()

        self._retrying("write", write)
        self._pending.clear()

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
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
        self.redis.close()


def read_online_features(client: redis.Redis, device_ids: list[str], prefix: str) -> list[dict[str, float]]:
    """The latest window features of each entity from the online store ({} when unknown)."""
    pipe = client.pipeline(transaction=False)
    for device in device_ids:
        pipe.hgetall(online_key(prefix, device))
    return [{k.decode(): float(v) for k, v in raw.items()} for raw in pipe.execute()]
