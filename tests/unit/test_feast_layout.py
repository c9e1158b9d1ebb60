"""Feast's Redis layout as ``streams.features.layout`` writes it: the bytes Feast 0.67 writes and reads.

The expected bytes below were produced by Feast's own functions (``_redis_key``, ``_mmh3``,
``Value.SerializeToString``) in ``.venv-feast``; ``tests/integration/test_feast_online.py``
checks the same against a live Feast on every run.
"""

from __future__ import annotations

import math
import pickle
import random
import struct

import numpy as np
import pytest

from streams.features.layout import (
    FeastLayout,
    Value,
    decode_timestamp_ns,
    decode_value,
    encode_timestamp,
    encode_value,
    entity_key,
    field_hash,
)
from streams.feast.repo import store_config
from streams.features.layout import INT_COLUMNS, Names, feature_columns
from pm_app import FEATURE_SET


def test_entity_key_is_feasts_serialization_v3_then_the_project():
    layout = FeastLayout.of(FEATURE_SET, "pm")
    assert layout.key("dev-001") == (b"\x01\x00\x00\x00\x02\x00\x00\x00\t\x00\x00\x00device_id"
                                     b"\x02\x00\x00\x00\x07\x00\x00\x00dev-001pm")
    assert entity_key("device_id", "é") == b"".join(
        [struct.pack("<I", 1), struct.pack("<I", 2), struct.pack("<I", 9), b"device_id",
         struct.pack("<I", 2), struct.pack("<I", 2), "é".encode()])
    with pytest.raises(ValueError, match="serialization_version 2"):
        entity_key("device_id", "x", version=2)


def test_field_names_are_feasts_murmur3_hashes():
    assert field_hash("device_window", "count") == b"\xa9R\xfb("
    assert field_hash("device_window", "window_end") == b"\xcd\xaaP\r"
    assert field_hash("device_window", "vibration_band_energy") == b"\xd3\x94\x7f\x97"
    layout = FeastLayout.of(FEATURE_SET, "pm")
    assert layout.read_fields[-1] == b"_ts:device_window"
    assert len(set(layout.read_fields)) == len(layout.fields) + 1 == len(feature_columns(FEATURE_SET)) + 1


def test_values_are_feasts_value_protos():
    assert encode_value(-7, integer=True) == b" \xf9\xff\xff\xff\xff\xff\xff\xff\xff\x01"
    assert encode_value(0.1, integer=False) == b")\x9a\x99\x99\x99\x99\x99\xb9?"
    assert encode_value(None, integer=False) == b"" and decode_value(b"") is None and decode_value(None) is None
    for v in (0, -1, 2**62, 1_795_000_005_000):
        assert decode_value(encode_value(v, integer=True)) == v
    assert decode_value(Value(string_val="x").SerializeToString()) == "x"


def test_double_fast_path_equals_the_protobuf_parse():
    rng = random.Random(3)
    values = [0.0, -0.0, 1e-310, -1e308, math.inf, -math.inf] + [rng.uniform(-1e6, 1e6) for _ in range(500)]
    for v in values:
        data = encode_value(v, integer=False)
        parsed = Value.FromString(data).double_val
        assert struct.pack("<d", decode_value(data)) == struct.pack("<d", parsed)
    assert math.isnan(decode_value(encode_value(math.nan, integer=False)))


def test_event_time_is_a_protobuf_timestamp_of_window_end():
    assert decode_timestamp_ns(encode_timestamp(1_795_000_005_123)) == 1_795_000_005_123_000_000
    assert decode_timestamp_ns(None) == 0


def test_rows_round_trip_through_the_hash_fields():
    layout = FeastLayout.of(FEATURE_SET, "pm")
    rng = random.Random(5)
    row = {"device_id": "dev-9", "window_start": 1000, "window_end": 6000, "count": 50,
           **{n: rng.gauss(0, 10) for n in FEATURE_SET.feature_names}}
    mapping = layout.encode_row(row)
    assert set(mapping) == set(layout.read_fields)
    back = layout.decode_row([mapping[f] for f in layout.read_fields])
    assert back == {k: v for k, v in row.items() if k != "device_id"}
    assert all(isinstance(back[c], int) for c in INT_COLUMNS)
    assert layout.decode_row([None] * len(layout.read_fields)) == {}

    # a null feature, or one another writer stored as float_val, takes the field-by-field path
    values = [mapping[f] for f in layout.read_fields]
    first = len(layout.int_fields)
    values[first] = b""
    values[first + 1] = Value(float_val=0.5).SerializeToString()
    back = layout.decode_row(values)
    assert back[layout.double_fields[0]] is None and back[layout.double_fields[1]] == 0.5
    assert all(back[n] == row[n] for n in layout.double_fields[2:])


def test_layout_names_come_from_the_feast_repository_helpers():
    layout = FeastLayout.of(FEATURE_SET, "pm")
    names = Names.of(FEATURE_SET)
    assert (layout.feature_view, layout.join_key) == (names.feature_view, names.join_key)
    config = store_config("pm", "127.0.0.1:6379", "/tmp/h", FEATURE_SET.online.ttl_s)
    assert layout.serialization_version == config["entity_key_serialization_version"]
    assert layout.key_ttl_s == config["online_store"]["key_ttl_seconds"]


def test_a_used_layout_pickles_to_an_equal_one():
    layout = FeastLayout.of(FEATURE_SET, "pm")
    row = {"window_start": 0, "window_end": 5000, "count": 1, **dict.fromkeys(FEATURE_SET.feature_names, 1.5)}
    values = [layout.encode_row(row)[f] for f in layout.read_fields]
    layout.decode_row(values)  # fills the cached encodings (a struct.Struct among them)
    copy = pickle.loads(pickle.dumps(layout))
    assert copy == layout and copy.decode_row(values) == layout.decode_row(values)


@pytest.mark.parametrize("project", ["", "_x", "-x", "a b", "a:b"])
def test_project_names_follow_feasts_rule(project):
    with pytest.raises(ValueError, match="Feast project"):
        FeastLayout.of(FEATURE_SET, project)


def _cells(packed: bytes) -> list[bytes]:
    """The values of a packed row, read as the HSET_NEWER script reads them: a length byte, then the value."""
    out, at = [], 0
    while at < len(packed):
        out.append(packed[at + 1:at + 1 + packed[at]])
        at += 1 + packed[at]
    return out


def test_rows_packed_a_batch_at_a_time_are_the_bytes_of_encode_row():
    layout = FeastLayout.of(FEATURE_SET, "pm")
    rng = random.Random(8)
    rows = [{"device_id": f"dev-{i}", "window_start": 1_795_000_000_000 + 5000 * i - i % 3,
             "window_end": 1_795_000_005_000 + 5000 * i + i % 1000, "count": i - 3,
             **{n: rng.gauss(0, 10 ** rng.randint(-3, 6)) for n in FEATURE_SET.feature_names}} for i in range(40)]
    rows[5]["rpm_mean"] = None
    rows[6]["window_end"] = 0  # an epoch time of zero: Timestamp's fields both omitted
    rows[7]["vibration_std"] = float("nan")  # a NaN is a value (a double), not Feast's null
    rows[8]["rpm_mean"], rows[8]["vibration_std"] = None, float("nan")
    for row, packed in zip(rows, layout.pack_rows(rows), strict=True):
        mapping = layout.encode_row(row)
        assert _cells(packed) == [mapping[f] for f in layout.read_fields], row["device_id"]


def test_rows_packed_from_columns_are_the_bytes_of_the_same_rows_packed_from_dicts():
    """The feature engine stages a batch's windows as columns (``pack_columns``): same bytes as ``pack_rows``."""
    layout = FeastLayout.of(FEATURE_SET, "pm")
    rng = random.Random(9)
    rows = [{"device_id": f"dev-{i}", "window_start": 1_795_000_000_000 + 5000 * i,
             "window_end": 1_795_000_005_000 + 5000 * i + i % 1000, "count": i,
             **{n: rng.gauss(0, 10 ** rng.randint(-3, 6)) for n in FEATURE_SET.feature_names}} for i in range(30)]
    rows[4]["vibration_std"] = float("nan")
    rows[6]["window_end"] = 0
    rows[7]["count"] = None
    ints = [np.array([r[f] for r in rows], dtype=object) if f == "count" else np.array([r[f] for r in rows])
            for f in layout.int_fields]
    doubles = np.array([[r[f] for f in layout.double_fields] for r in rows])
    event_ms = np.array([layout.event_time_ms(r) for r in rows])
    assert layout.pack_columns(ints, doubles, event_ms) == layout.pack_rows(rows)
    assert layout.pack_columns([c[:0] for c in ints], doubles[:0], event_ms[:0]) == []


def test_a_double_field_of_many_rows_decodes_as_one_array_where_each_row_decodes():
    layout = FeastLayout.of(FEATURE_SET, "pm")
    rng = random.Random(8)
    rows = [{"device_id": f"dev-{i}", "window_start": 0, "window_end": 5000, "count": 50,
             **{n: rng.gauss(0, 10) for n in FEATURE_SET.feature_names}} for i in range(5)]
    replies = [[layout.encode_row(r)[f] for f in layout.read_fields] for r in rows]
    first = len(layout.int_fields)
    name = layout.double_fields[1]
    replies[1][first + 1] = b""  # Feast's null
    replies[2][first + 1] = Value(float_val=0.5).SerializeToString()  # another writer's encoding
    replies[3] = [None] * len(layout.read_fields)  # no row
    values, valid = layout.decode_doubles(replies, name)
    assert valid.tolist() == [True, False, False, False, True]
    for i in (0, 4):
        assert values[i] == layout.decode_row(replies[i])[name] == rows[i][name]
    assert layout.decode_doubles([], name)[0].shape == (0,)
