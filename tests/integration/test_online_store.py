"""The online store against the test stack's Redis: the writer, the lookups, Feast's rules on both.

- rows written by ``OnlineWriter`` land in Feast's layout (one hash per entity and project, the
  view's fields and ``_ts``, the key TTL) and read back equal through ``read_online_features``;
- an older or equal row is skipped (Feast's newest-wins rule), a newer one replaces;
- the engine's progress hash is written with the rows, by the last command of their round trip;
- two projects do not see each other's rows;
- ``OnlineLookup`` coalesces concurrent lookups into shared round trips, caps the keys of one
  command, returns what the synchronous read returns, and reloads its script after SCRIPT FLUSH.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
import redis

from streams.features.layout import FeastLayout
from pm_app import FEATURE_SET
from streams.errors import DeliveryError
from streams.features.online import WRITE_CHUNK, OnlineLookup, OnlineWriter, read_online_features

pytestmark = pytest.mark.integration


def _row(device: str, window_end: int, rng: random.Random) -> dict:
    return {"device_id": device, "window_start": window_end - 5000, "window_end": window_end,
            "count": rng.randint(1, 50), **{n: rng.uniform(-100, 100) for n in FEATURE_SET.feature_names}}


def _project() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _served(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "device_id"}


def test_writer_writes_feasts_layout_and_keeps_the_newest_row(stack):
    layout = FeastLayout.of(FEATURE_SET, _project())
    other = FeastLayout.of(FEATURE_SET, _project())
    rng = random.Random(1)
    writer = OnlineWriter(stack.redis_url, layout)
    client = redis.Redis.from_url(stack.redis_url)
    try:
        writer.setup()
        a1, a2, b1 = _row("a", 10_000, rng), _row("a", 15_000, rng), _row("b", 10_000, rng)
        for row in (a2, a1, b1):  # a's older window staged after its newer one: the newer is kept
            writer.stage(row)
        writer.flush()
        assert writer.written == 2 and writer.skipped == 0
        assert read_online_features(client, ["a", "b", "unknown"], layout) == [_served(a2), _served(b1), {}]
        assert writer.read_hash(b"progress-" + layout.project.encode(), [b"p:t:0"]) == [None]

        # the Redis hash is Feast's: the view's fields and _ts, nothing else, with the key TTL
        raw = client.hgetall(layout.key("a"))
        assert set(raw) == set(layout.read_fields)
        assert 0 < client.ttl(layout.key("a")) <= FEATURE_SET.online.ttl_s

        # Feast's rule: an older or equal window is skipped, a newer one replaces
        a_old, a_same, b2 = _row("a", 5_000, rng), _row("a", 15_000, rng), _row("b", 20_000, rng)
        writer.stage(a_old)
        writer.stage(b2)
        writer.flush()
        writer.stage(a_same)
        writer.flush((b"progress-" + layout.project.encode(), {b"p:t:0": b"17 5000"}))
        assert writer.skipped == 2 and writer.written == 3
        assert writer.read_hash(b"progress-" + layout.project.encode(), [b"p:t:0", b"p:t:1"]) == [b"17 5000", None]
        assert 0 < client.ttl(b"progress-" + layout.project.encode()) <= FEATURE_SET.online.ttl_s
        assert read_online_features(client, ["a", "b"], layout) == [_served(a2), _served(b2)]

        # another project is another namespace
        assert read_online_features(client, ["a", "b"], other) == [{}, {}]
        assert read_online_features(client, [], layout) == []
    finally:
        writer.close()
        client.close()


def test_a_fleets_rows_go_in_commands_of_a_few_hundred_and_the_progress_with_the_last(stack):
    """The windows of a whole fleet closing at once: written in one round trip of several commands (Redis serves
    readers between them), every row and the progress there; a Redis that lost its scripts is handled."""
    layout = FeastLayout.of(FEATURE_SET, _project())
    rng = random.Random(2)
    writer = OnlineWriter(stack.redis_url, layout)
    client = redis.Redis.from_url(stack.redis_url)
    progress_key = b"progress-" + layout.project.encode()
    try:
        writer.setup()
        rows = [_row(f"dev-{i:05d}", 10_000, rng) for i in range(2 * WRITE_CHUNK + 7)]
        for row in rows:
            writer.stage(row)
        client.script_flush()  # as after a Redis restart: the first command of the round trip is refused
        writer.flush((progress_key, {b"p:t:0": b"99 10000"}))
        assert writer.written == len(rows) and writer.skipped == 0
        assert read_online_features(client, [r["device_id"] for r in rows], layout) == [_served(r) for r in rows]
        assert writer.read_hash(progress_key, [b"p:t:0"]) == [b"99 10000"]

        writer.flush((progress_key, {b"p:t:0": b"120 15000"}))  # the progress alone, no rows staged
        assert writer.read_hash(progress_key, [b"p:t:0"]) == [b"120 15000"] and writer.written == len(rows)
    finally:
        writer.close()
        client.close()


def test_a_write_in_the_writers_thread_lands_and_one_that_failed_goes_again_with_the_next(stack):
    """``flush_async`` (the engine's flush: the delivery loop goes on while Redis writes): the future is done when
    the rows and the progress are written; a write that failed gives its rows and progress back to the next one
    (a newer row of the same entity staged since wins), so nothing of it is lost."""
    layout = FeastLayout.of(FEATURE_SET, _project())
    rng = random.Random(3)
    progress_key = b"progress-" + layout.project.encode()
    writer = OnlineWriter("redis://127.0.0.1:1/0", layout, retry_s=0.05, timeout_s=0.2)  # nothing listens there
    client = redis.Redis.from_url(stack.redis_url)
    try:
        assert writer.flush_async() is None  # nothing staged, no progress: no write
        a1, b1 = _row("a", 10_000, rng), _row("b", 10_000, rng)
        writer.stage(a1)
        writer.stage(b1)
        failed = writer.flush_async((progress_key, {b"p:t:0": b"7 10000"}))
        with pytest.raises(DeliveryError):
            failed.result()
        a2 = _row("a", 15_000, rng)  # staged while the write failed: newer than the failed row of a
        writer.stage(a2)
        writer.redis = redis.Redis.from_url(stack.redis_url)  # Redis is back
        written = writer.flush_async((progress_key, {b"p:t:1": b"3 5000"}))
        assert written.result() is None and written.done()
        assert read_online_features(client, ["a", "b"], layout) == [_served(a2), _served(b1)]
        assert writer.read_hash(progress_key, [b"p:t:0", b"p:t:1"]) == [b"7 10000", b"3 5000"]
        assert writer.written == 2 and writer.flush_async() is None  # nothing left over
    finally:
        writer.close()
        client.close()


def test_async_lookup_coalesces_and_equals_the_synchronous_read(stack):
    layout = FeastLayout.of(FEATURE_SET, _project())
    rng = random.Random(2)
    rows = [_row(f"dev-{i:04d}", 10_000, rng) for i in range(300)]
    writer = OnlineWriter(stack.redis_url, layout)
    for row in rows:
        writer.stage(row)
    writer.flush()
    writer.close()
    client = redis.Redis.from_url(stack.redis_url)
    calls = [[f"dev-{rng.randrange(320):04d}" for _ in range(rng.choice((1, 3, 10)))] for _ in range(200)]
    expected = [read_online_features(client, ids, layout) for ids in calls]

    async def run() -> tuple[list, int, list]:
        lookup = OnlineLookup(stack.redis_url, layout, max_in_flight=1, max_keys=64)
        try:
            got = await asyncio.gather(*(lookup.get(ids) for ids in calls))  # all in one loop tick
            trips = lookup.round_trips
            client.script_flush()  # a restarted Redis has no scripts: the lookup loads it again
            again = await lookup.get(calls[0])
            return got, trips, again
        finally:
            await lookup.close()

    try:
        got, trips, again = asyncio.run(run())
    finally:
        client.close()
    assert got == expected
    assert again == expected[0]
    keys = sum(len(ids) for ids in calls)
    assert keys / 64 <= trips < len(calls) / 2, (keys, trips)  # shared round trips, at most 64 keys each
    assert any(row == {} for result in expected for row in result)  # unknown devices were asked for too
