"""The Faust feature job's changelog state is plain JSON: it round-trips, and hostile bytes run nothing."""

from __future__ import annotations

import math
import pickle

import pytest

from reference import PM
from streams.features.compute import PartitionWindows
from streams.features.faust_job import decode_meta, decode_windows, encode_meta, encode_windows
from streams.features.spec import load_feature_set

FEATURE_SET = PM / "features" / "device_window.yaml"


def test_the_state_round_trips_with_missing_readings_and_header_bytes() -> None:
    fs = load_feature_set(FEATURE_SET)
    state = PartitionWindows(fs)
    row = [math.nan if i == 1 else float(i) for i in range(len(fs.inputs))]
    state.add("dev-1", 1_000, row, None, {"event_id": b"e-1", "trace_id": b"\x00\xffbinary"})
    state.add("dev-2", 1_500, row, None, {})
    state.add("dev-1", 1_700, row, None, None)
    restored = PartitionWindows(fs)
    assert decode_meta(encode_meta(state, 41), restored) == 41
    assert (restored.stream_time, restored.closed_through) == (state.stream_time, state.closed_through)
    for entity in ("dev-1", "dev-2"):
        mine = [w for (e, _), w in state.open.items() if e == entity]
        added, again = decode_windows(encode_windows(mine, 7))
        assert added == 7 and [w.start for w in again] == [w.start for w in mine] and mine
        for window, back in zip(mine, again, strict=True):
            assert back.ts == window.ts and back.last == (window.last or None)
            assert all(math.isnan(a) and math.isnan(b) or a == b
                       for r, s in zip(window.rows, back.rows) for a, b in zip(r, s))


def test_a_reading_read_again_moves_the_clock_only() -> None:
    fs = load_feature_set(FEATURE_SET)
    state = PartitionWindows(fs)
    state.add("dev-1", 1_000, [1.0] * len(fs.inputs))
    reach = fs.window.size_ms + fs.window.allowed_lateness_ms
    assert state.advance(500) == [] and state.stream_time == 1_000
    closed = state.advance(1_000 - 1_000 % fs.window.hop_ms + reach)
    assert [(w["entity"], w["count"]) for w in closed] == [("dev-1", 1)] * len(closed) and closed


class Boom:
    def __reduce__(self):
        return (pytest.fail, ("the changelog ran code from a record",))


@pytest.mark.parametrize("hostile", [pickle.dumps(Boom()), b"", b"{}", b'{"stream_time": "x"}', b"\x80\x04K\x01.",
                                     b'{"applied": 3, "open": [{"start": 0}]}'])
def test_bytes_that_are_not_a_state_are_refused_and_run_nothing(hostile: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode_meta(hostile, PartitionWindows(load_feature_set(FEATURE_SET)))
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode_windows(hostile)


class _Event:
    acked = 0

    def ack(self) -> None:
        self.acked += 1


def test_a_reading_is_acknowledged_only_once_its_changelog_records_are() -> None:
    """The job acknowledges a reading (so Faust may commit its offset) after the broker acknowledged the
    changelog records of the state it changed, never before, and never when one of them failed."""
    import asyncio

    from streams.features.faust_job import ack_when_durable

    async def scenario() -> tuple[int, int, int, int]:
        loop = asyncio.get_running_loop()
        durable, failed, nothing = _Event(), _Event(), _Event()
        sent = [loop.create_future(), loop.create_future()]
        ack_when_durable(durable, sent)
        sent[0].set_result("metadata")
        await asyncio.sleep(0)
        before = durable.acked  # one record of two acknowledged: not yet
        sent[1].set_result("metadata")
        bad = [loop.create_future()]
        ack_when_durable(failed, bad)
        bad[0].set_exception(OSError("broker gone"))
        ack_when_durable(nothing, [])
        for _ in range(3):
            await asyncio.sleep(0)
        return before, durable.acked, failed.acked, nothing.acked

    assert asyncio.run(scenario()) == (0, 1, 0, 1)


def test_the_offsets_between_the_last_applied_and_the_one_delivered_are_the_ones_to_read() -> None:
    """A partition's state applies every offset in order: a record delivered past ``applied + 1`` means the
    offsets in between were not delivered (Faust can drop records fetched while it recovers) or are empty in Kafka;
    either way they are read from the partition before it."""
    from streams.features.faust_job import missed

    assert missed(41, 42) is None  # the next one
    assert missed(41, 40) is None and missed(41, 41) is None  # read again after a restart: already applied
    assert missed(41, 43) == (42, 43)  # one not delivered
    assert missed(41, 50) == (42, 50)
    assert missed(-1, 0) is None  # a partition's first record
    assert missed(-1, 7) == (0, 7)  # nothing applied yet: from the partition's beginning


def test_a_record_read_to_fill_a_gap_is_acknowledged_to_faust_as_a_delivered_one() -> None:
    """Its offset reaches the consumer's acknowledged offsets, so the offsets after it can commit."""
    from faust.types.tuples import TP

    from streams.features.faust_job import SourceRecord, Undelivered

    class _Consumer:
        def __init__(self) -> None:
            self.acked: list[tuple[TP, int]] = []

        def ack(self, message) -> bool:  # as faust's Consumer.ack: marks the message, records its offset
            if message.acked:
                return False
            message.acked = True
            self.acked.append((message.tp, message.offset))
            return True

    class _App:
        consumer = _Consumer()
        consumer_generation_id = 3

    record = SourceRecord("pm.ingest.telemetry", 2, 98, b"dev-4", b"\x00value", (("event_id", b"e"),))
    undelivered = Undelivered(_App(), record)
    assert undelivered.ack() is True
    assert undelivered.ack() is False  # once
    assert _App.consumer.acked == [(TP("pm.ingest.telemetry", 2), 98)]
