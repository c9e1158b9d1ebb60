"""The Faust feature job's changelog state is plain JSON: it round-trips, and hostile bytes run nothing."""

from __future__ import annotations

import math
import pickle

import pytest

from reference import PM
from streams.features.compute import PartitionWindows
from streams.features.faust_job import decode_state, encode_state
from streams.features.spec import load_feature_set

FEATURE_SET = PM / "features" / "device_window.yaml"


def test_the_state_round_trips_with_missing_readings_and_header_bytes() -> None:
    fs = load_feature_set(FEATURE_SET)
    state = PartitionWindows(fs)
    row = [math.nan if i == 1 else float(i) for i in range(len(fs.inputs))]
    state.add("dev-1", 1_000, row, None, {"event_id": b"e-1", "trace_id": b"\x00\xffbinary"})
    state.add("dev-2", 1_500, row, None, {})
    state.add("dev-1", 1_700, row, None, None)
    encoded = encode_state(state, 41)
    restored = PartitionWindows(fs)
    assert decode_state(encoded, restored) == 41
    assert (restored.stream_time, restored.closed_through) == (state.stream_time, state.closed_through)
    assert restored.open.keys() == state.open.keys() and len(state.open) >= 2
    for key, window in state.open.items():
        again = restored.open[key]
        assert again.ts == window.ts and again.last == (window.last or None)
        assert all(math.isnan(a) and math.isnan(b) or a == b for r, s in zip(window.rows, again.rows) for a, b in zip(r, s))


class Boom:
    def __reduce__(self):
        return (pytest.fail, ("the changelog ran code from a record",))


@pytest.mark.parametrize("hostile", [pickle.dumps(Boom()), b"", b"{}", b'{"stream_time": "x"}', b"\x80\x04K\x01.",
                                     b'{"stream_time": 1, "closed_through": 0, "applied": 3, "open": [{"start": 0}]}'])
def test_bytes_that_are_not_a_state_are_refused_and_run_nothing(hostile: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode_state(hostile, PartitionWindows(load_feature_set(FEATURE_SET)))
