"""The batch codec writes exactly fastavro's bytes and reads only what it can prove."""

from __future__ import annotations

import io
import struct

import fastavro
import numpy as np
import pytest

from streams.wire import plain
from streams.columnar import BatchCodec, MapColumn
from reference import load_schema

HEADER = struct.pack(">bI", 0, 42)

SCHEMA = {
    "type": "record", "name": "Everything", "namespace": "t",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "n", "type": "int"},
        {"name": "x", "type": "double"},
        {"name": "f", "type": "float"},
        {"name": "ok", "type": "boolean"},
        {"name": "maybe", "type": ["null", "double"]},
        {"name": "later", "type": ["string", "null"]},
        {"name": "blob", "type": "bytes"},
        {"name": "level", "type": {"type": "enum", "name": "Level", "symbols": ["LOW", "MID", "HIGH"]}},
    ],
}


def fastavro_bytes(schema: dict, record: dict) -> bytes:
    buf = io.BytesIO()
    buf.write(HEADER)
    fastavro.schemaless_writer(buf, fastavro.parse_schema(plain(schema)), record)
    return buf.getvalue()


def rows(n: int, seed: int = 7) -> list[dict]:
    rng = np.random.default_rng(seed)
    big = [0, 1, -1, 63, 64, -64, -65, 2**31 - 1, -(2**31), 2**53, -(2**62), 2**63 - 1, -(2**63)]
    out = []
    for i in range(n):
        out.append({
            "id": f"dev-{i}-" + "é" * (i % 3) + "x" * int(rng.integers(0, 200)),
            "ts": big[i % len(big)] if i % 2 else int(rng.integers(-(2**40), 2**40)),
            "n": int(rng.integers(-(2**31), 2**31)),
            "x": float(rng.normal() * 10 ** int(rng.integers(-5, 5))),
            "f": float(np.float32(rng.normal())),
            "ok": bool(i % 3 == 0),
            "maybe": None if i % 4 == 0 else float(rng.normal()),
            "later": None if i % 5 == 1 else f"s{i}",
            "blob": bytes(rng.integers(0, 256, int(rng.integers(0, 20))).astype(np.uint8)),
            "level": ["LOW", "MID", "HIGH"][i % 3],
        })
    return out


def columns(records: list[dict]) -> dict[str, list]:
    return {f["name"]: [r[f["name"]] for r in records] for f in SCHEMA["fields"]}


def test_encode_writes_fastavros_bytes():
    records = rows(500)
    encoded = BatchCodec(SCHEMA, HEADER).encode(columns(records), len(records))
    assert encoded == [fastavro_bytes(SCHEMA, r) for r in records]


def test_encode_takes_numpy_columns_and_maps_with_fixed_keys():
    schema = load_schema("pm.predictions.anomaly-value")
    n = 300
    rng = np.random.default_rng(3)
    probabilities = rng.random((n, 3))
    classes = ("healthy", "bearing_wear", "overheating")
    cols = {
        "event_id": [f"e{i}" for i in range(n)], "device_id": [f"dev-{i % 7}" for i in range(n)],
        "window_start": np.arange(n, dtype=np.int64) * 5000 + 1_800_000_000_000,
        "window_end": np.arange(n, dtype=np.int64) * 5000 + 1_800_000_005_000,
        "score": 1 - probabilities[:, 0], "label": [classes[i % 3] for i in range(n)],
        "confidence": probabilities.max(axis=1), "probabilities": MapColumn(classes, probabilities),
        "model_name": ["anomaly"] * n, "model_version": ["2"] * n, "inference_ms": np.full(n, 1.25),
        "trace_id": ["0" * 32] * n,
    }
    encoded = BatchCodec(schema, HEADER).encode(cols, n)
    for i in (0, 1, n // 2, n - 1):
        expected = {k: (v[i].item() if isinstance(v, np.ndarray) else v[i]) for k, v in cols.items() if k != "probabilities"}
        expected["probabilities"] = dict(zip(classes, probabilities[i].tolist()))
        assert encoded[i] == fastavro_bytes(schema, expected)


def test_decode_reads_back_what_fastavro_wrote():
    records = rows(400, seed=11)
    values = [fastavro_bytes(SCHEMA, r) for r in records]
    decoded = BatchCodec(SCHEMA, HEADER).decode(values)
    assert decoded is not None
    for name in ("id", "ts", "n", "x", "ok", "maybe", "later", "blob", "level"):
        column = decoded[name]
        got = column.tolist() if isinstance(column, np.ndarray) else column
        assert got == [r[name] for r in records], name
    assert np.allclose(decoded["f"], [r["f"] for r in records])


def test_decode_of_the_feature_contract_gives_numpy_columns():
    schema = load_schema("pm.features.device_window-value")
    record = {f["name"]: 1.5 for f in schema["fields"]}
    record.update(device_id="dev-1", window_start=1_800_000_000_000, window_end=1_800_000_005_000, count=50)
    decoded = BatchCodec(schema, HEADER).decode([fastavro_bytes(schema, record)] * 3)
    assert decoded["device_id"] == ["dev-1"] * 3
    assert decoded["window_start"].dtype == np.int64 and decoded["window_start"].tolist() == [1_800_000_000_000] * 3
    assert decoded["temperature_mean"].dtype == np.float64


@pytest.mark.parametrize("damage", ["truncated", "trailing", "other_schema_id", "bad_magic", "none", "bad_utf8",
                                    "bad_branch", "bad_enum", "short"])
def test_decode_refuses_a_batch_with_any_bad_value(damage):
    records = rows(20, seed=5)
    values: list = [fastavro_bytes(SCHEMA, r) for r in records]
    victim = values[7]
    values[7] = {
        "truncated": victim[:-1],
        "trailing": victim + b"\x00",
        "other_schema_id": struct.pack(">bI", 0, 43) + victim[5:],
        "bad_magic": b"\x01" + victim[1:],
        "none": None,
        "bad_utf8": fastavro_bytes(SCHEMA, {**records[7], "id": "ab"}).replace(b"ab", b"\xff\xfe"),
        "bad_branch": None,
        "bad_enum": None,
        "short": b"\x00\x00",
    }[damage]
    if damage in ("bad_branch", "bad_enum"):
        schema = {"type": "record", "name": "Small", "fields": [
            {"name": "maybe", "type": ["null", "long"]},
            {"name": "level", "type": {"type": "enum", "name": "L", "symbols": ["A", "B"]}}]}
        good = fastavro_bytes(schema, {"maybe": 5, "level": "B"})
        bad = HEADER + (b"\x04\x0a\x02" if damage == "bad_branch" else b"\x02\x0a\x04")
        decoded = BatchCodec(schema, HEADER).decode([good, good])
        assert decoded["maybe"].tolist() == [5, 5] and decoded["level"] == ["B", "B"]
        assert BatchCodec(schema, HEADER).decode([good, bad, good]) is None
        return
    assert BatchCodec(SCHEMA, HEADER).decode(values) is None
    assert BatchCodec(SCHEMA, HEADER).decode(values[:7] + values[8:]) is not None


def test_unsupported_schemas_are_said_so():
    nested = {"type": "record", "name": "N", "fields": [{"name": "inner", "type": {"type": "array", "items": "long"}}]}
    assert not BatchCodec.supports(nested)
    assert BatchCodec.supports(SCHEMA)


def _prediction(i: int, probabilities: dict) -> dict:
    return {"event_id": f"e{i}", "device_id": f"dev-{i}", "window_start": 1000 * i, "window_end": 1000 * i + 5000,
            "score": 0.1 * i, "label": "healthy", "confidence": 0.9, "probabilities": probabilities,
            "model_name": "anomaly", "model_version": "1", "inference_ms": 2.5, "trace_id": "t"}


def test_decode_reads_maps_with_the_same_keys_in_every_row():
    schema = load_schema("pm.predictions.anomaly-value")
    rows = [_prediction(i, {"healthy": 1 - 0.1 * i, "bearing_wear": 0.1 * i, "overheating": 0.0}) for i in range(6)]
    decoded = BatchCodec(schema, HEADER).decode([fastavro_bytes(schema, r) for r in rows])
    assert decoded is not None
    probabilities = decoded["probabilities"]
    assert isinstance(probabilities, MapColumn) and probabilities.keys == ("healthy", "bearing_wear", "overheating")
    assert probabilities.values.tolist() == [list(r["probabilities"].values()) for r in rows]
    assert decoded["inference_ms"].tolist() == [2.5] * 6 and decoded["trace_id"] == ["t"] * 6
    empty = [fastavro_bytes(schema, _prediction(i, {})) for i in range(3)]
    assert BatchCodec(schema, HEADER).decode(empty)["probabilities"].keys == ()


@pytest.mark.parametrize("other", [{"healthy": 0.5, "overheating": 0.5},  # fewer keys
                                   {"overheating": 0.0, "healthy": 1.0, "bearing_wear": 0.0},  # another order
                                   {"healthy": 1.0, "bearing_weat": 0.0, "overheating": 0.0}])  # another key
def test_decode_leaves_maps_with_other_keys_to_the_record_codec(other):
    schema = load_schema("pm.predictions.anomaly-value")
    same = {"healthy": 1.0, "bearing_wear": 0.0, "overheating": 0.0}
    values = [fastavro_bytes(schema, _prediction(i, same)) for i in range(3)]
    assert BatchCodec(schema, HEADER).decode(values + [fastavro_bytes(schema, _prediction(3, other))]) is None


def test_small_batches_with_a_map_are_written_with_the_same_bytes():
    """Below ``small_encode`` rows a prediction batch (a map of class probabilities) goes through the row path,
    its map cut from the column path's bytes: the bytes of the column path and of fastavro record by record."""
    schema = load_schema("pm.predictions.anomaly-value")
    writer = lambda record: fastavro_bytes(schema, record)  # noqa: E731 - the per-record codec
    small = BatchCodec(schema, HEADER, small_batch=32, small_encode=100, record_writer=writer)
    big = BatchCodec(schema, HEADER)
    classes = ("healthy", "bearing_wear", "overheating")
    for n in (1, 2, 5, 64, 99):
        p = np.random.default_rng(n).random((n, 3)).astype(np.float32)
        cols = {"event_id": [f"e{i}" for i in range(n)], "device_id": [f"d{i}" for i in range(n)],
                "window_start": np.arange(n, dtype=np.int64), "window_end": np.arange(n, dtype=np.int64) + 5000,
                "score": 1.0 - p[:, 0], "label": ["healthy"] * n, "confidence": p.max(axis=1),
                "probabilities": MapColumn(classes, p), "model_name": ["anomaly"] * n, "model_version": ["1"] * n,
                "inference_ms": np.full(n, 0.5), "trace_id": ["t" * 32] * n}
        written = small.encode(cols, n)
        assert written == big.encode(cols, n)
        assert written == [writer(small._row(cols, i)) for i in range(n)]


def test_small_batches_are_read_record_by_record():
    records = rows(40, seed=2)
    values = [fastavro_bytes(SCHEMA, r) for r in records]
    reader = BatchCodec(SCHEMA, HEADER, small_batch=32, record_writer=lambda r: fastavro_bytes(SCHEMA, r))
    assert reader.decode(values[:31]) is None  # the caller reads these one by one
    assert reader.decode(values) is not None
    with pytest.raises(ValueError):
        BatchCodec(SCHEMA, HEADER, small_batch=8)
    with pytest.raises(ValueError):
        BatchCodec(SCHEMA, HEADER, small_encode=8)


@pytest.mark.parametrize("as_numpy", [False, True])
def test_small_batches_written_row_by_row_are_fastavros_bytes(as_numpy):
    """Below ``small_encode`` rows a batch is written by the Python row path: every kind, nulls in either union
    branch, longs at the edges of 64 bits, strings past one length byte, enums, numpy columns alike."""
    records = rows(40, seed=5)
    codec = BatchCodec(SCHEMA, HEADER, small_encode=100, record_writer=lambda r: fastavro_bytes(SCHEMA, r))
    cols = columns(records)
    if as_numpy:
        cols.update(ts=np.array(cols["ts"], dtype=np.int64), n=np.array(cols["n"], dtype=np.int32),
                    x=np.array(cols["x"]), f=np.array(cols["f"], dtype=np.float32), ok=np.array(cols["ok"]))
    for n in (1, 2, 7, 40):
        part = {name: column[:n] for name, column in cols.items()}
        assert codec.encode(part, n) == [fastavro_bytes(SCHEMA, r) for r in records[:n]]


@pytest.mark.parametrize("field, bad", [("ts", 1.5), ("ts", 2**63), ("n", 2**31), ("n", "7"), ("x", "1.0"),
                                        ("id", 7), ("level", "NONE")])
def test_the_row_path_refuses_a_value_of_the_wrong_type_or_range(field, bad):
    records = rows(2)
    records[1] = records[1] | {field: bad}
    codec = BatchCodec(SCHEMA, HEADER, small_encode=100, record_writer=lambda r: fastavro_bytes(SCHEMA, r))
    with pytest.raises((TypeError, ValueError, KeyError, struct.error)):
        codec.encode(columns(records), 2)


def test_decode_of_chosen_fields_with_nulls_as_nan():
    """The numeric stages' path: only the fields asked for, nullable doubles as float arrays with NaN."""
    schema = load_schema("pm.ingest.telemetry-value")
    sensors = ("temperature", "vibration", "current", "pressure", "rpm")
    records = [{"event_id": f"e-{i}-" + "é" * (i % 2), "device_id": f"dev-{i % 5}", "ts": 1_800_000_000_000 + i,
                **{s: None if (i + j) % 7 == 0 else i * 0.5 + j for j, s in enumerate(sensors)}} for i in range(64)]
    values = [fastavro_bytes(schema, r) for r in records]
    codec = BatchCodec(schema, HEADER)
    decoded = codec.decode(values, only=("device_id", "ts", *sensors), nulls_as_nan=True)
    assert list(decoded) == ["device_id", "ts", *sensors]
    assert decoded["device_id"] == [r["device_id"] for r in records] and decoded["ts"].tolist() == [r["ts"] for r in records]
    for s in sensors:
        expected = np.array([np.nan if r[s] is None else r[s] for r in records])
        assert decoded[s].dtype == np.float64 and np.array_equal(decoded[s], expected, equal_nan=True), s
    full = [r for r in records if None not in r.values()]  # no null anywhere: the five read in one gather
    decoded = codec.decode([fastavro_bytes(schema, r) for r in full], nulls_as_nan=True)
    assert decoded["rpm"].tolist() == [r["rpm"] for r in full] and decoded["event_id"] == [r["event_id"] for r in full]


def test_a_skipped_string_is_still_proven_utf8():
    schema = load_schema("pm.ingest.telemetry-value")
    record = {"event_id": "ab", "device_id": "dev-1", "ts": 1, "temperature": 1.0, "vibration": None, "current": 2.0,
              "pressure": 3.0, "rpm": 4.0}
    good = fastavro_bytes(schema, record)
    bad = good.replace(b"ab", b"\xff\xfe", 1)
    codec = BatchCodec(schema, HEADER)
    assert codec.decode([good, good], only=("device_id",))["device_id"] == ["dev-1", "dev-1"]
    assert codec.decode([good, bad], only=("device_id",)) is None


def test_a_skipped_string_at_the_batch_end_or_empty_before_high_bytes_is_judged_by_its_own_bytes():
    """The UTF-8 proof of a skipped string looks at that string's bytes only: the last string of the batch is
    checked to its end, and an empty one before a byte ≥ 0x80 (a double's) is valid."""
    schema = {"type": "record", "name": "Note", "fields": [{"name": "id", "type": "long"}, {"name": "x", "type": "double"},
                                                           {"name": "note", "type": ["null", "string"]}]}
    codec = BatchCodec(schema, HEADER)
    rows = [{"id": i, "x": -1.5e300, "note": ["", None, "né", "plain"][i % 4]} for i in range(9)]
    good = [fastavro_bytes(schema, r) for r in rows]
    assert codec.decode(good, only=("id",))["id"].tolist() == list(range(9))
    bad_last = good[:-1] + [fastavro_bytes(schema, {**rows[-1], "note": "zz"}).replace(b"zz", b"\xc3\x28")]
    assert codec.decode(bad_last, only=("id",)) is None


RUNS = {
    "type": "record", "name": "Runs", "namespace": "t",
    "fields": [
        {"name": "d1", "type": "double"}, {"name": "d2", "type": "double"}, {"name": "d3", "type": "double"},
        {"name": "f1", "type": "float"}, {"name": "f2", "type": "float"},
        {"name": "n1", "type": ["null", "double"]}, {"name": "n2", "type": ["double", "null"]},
        {"name": "n3", "type": ["null", "double"]},
        {"name": "g1", "type": ["null", "float"]}, {"name": "g2", "type": ["float", "null"]},
    ],
}


@pytest.mark.parametrize("null_at", [None, "n2", "g1"])
def test_runs_of_one_type_read_at_once_give_fastavros_values(null_at):
    """A run of neighbouring doubles (or floats, or nullable ones of either union order) is read as one
    matrix; each column is still its own field's values, nulls still read field by field."""
    rng = np.random.default_rng(5)
    records = []
    for i in range(70):
        record = {f["name"]: float(np.float32(rng.normal())) for f in RUNS["fields"]}
        if null_at is not None and i == 33:
            record[null_at] = None
        records.append(record)
    decoded = BatchCodec(RUNS, HEADER).decode([fastavro_bytes(RUNS, r) for r in records])
    assert decoded is not None
    for f in RUNS["fields"]:
        got = decoded[f["name"]]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert got == [r[f["name"]] for r in records], f["name"]
