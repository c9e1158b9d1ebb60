"""The Faust feature job's changelog state is plain JSON: it round-trips, and hostile bytes run nothing."""

from __future__ import annotations

import math
import pickle

import pytest

from reference import PM
from streams.features.compute import EntityWindows
from streams.features.faust_job import decode_state, encode_state
from streams.features.spec import load_feature_set

FEATURE_SET = PM / "features" / "device_window.yaml"


def test_the_state_round_trips_with_missing_readings_and_header_bytes() -> None:
    fs = load_feature_set(FEATURE_SET)
    state = EntityWindows(fs)
    row = [math.nan if i == 1 else float(i) for i in range(len(fs.inputs))]
    state.add(1_000, row, None, {"event_id": b"e-1", "trace_id": b"\x00\xffbinary"})
    state.add(1_500, row, None, {})
    encoded = encode_state(state, {0: 41, 2: 7})
    restored = EntityWindows(fs)
    assert decode_state(encoded, restored) == {0: 41, 2: 7}
    assert (restored.watermark, restored.emitted_end) == (state.watermark, state.emitted_end)
    assert restored.open.keys() == state.open.keys()
    for start, window in state.open.items():
        again = restored.open[start]
        assert again.ts == window.ts and again.last == (window.last or None)
        assert all(math.isnan(a) and math.isnan(b) or a == b for r, s in zip(window.rows, again.rows) for a, b in zip(r, s))


class Boom:
    def __reduce__(self):
        return (pytest.fail, ("the changelog ran code from a record",))


@pytest.mark.parametrize("hostile", [pickle.dumps(Boom()), b"", b"{}", b'{"watermark": "x"}', b"\x80\x04K\x01.",
                                     b'{"watermark": 1, "emitted_end": 0, "applied": {}, "open": [{"start": 0}]}'])
def test_bytes_that_are_not_a_state_are_refused_and_run_nothing(hostile: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode_state(hostile, EntityWindows(load_feature_set(FEATURE_SET)))
