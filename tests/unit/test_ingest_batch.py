"""The whole-batch ingest path gives exactly what the reading-at-a-time path gives.

Two ingest processors with the same settings see the same stream of batches; one may take the
batch path (``Validator.admit_clean`` + one batch encode), the other is forced through
``admit`` one reading at a time. Outputs (topic, key, value bytes, headers), DLQ reasons and the
validators' memory (dedup ids, latest times) must be identical, batch after batch, for clean
batches and for batches with every kind of bad reading mixed in.
"""

from __future__ import annotations

import io
import json
import random
import struct

import fastavro
import pytest

from streams.wire import plain
from streams.columnar import BatchCodec
from streams.delivery import Record
from streams.ingest import IngestSettings, IngestValidator
from reference import load_schema

NOW = 1_800_000_000_000
SCHEMA = load_schema("pm.ingest.telemetry-value")
HEADER = struct.pack(">bI", 0, 7)


class Codec:
    """What IngestValidator needs of an AvroCodec, without a registry."""

    schema_id = 7
    schema_json = SCHEMA

    def __init__(self, batch: bool):
        self.parsed = fastavro.parse_schema(plain(SCHEMA))
        self.batch = BatchCodec(SCHEMA, HEADER) if batch else None

    def encode(self, record: dict) -> bytes:
        buf = io.BytesIO()
        buf.write(HEADER)
        fastavro.schemaless_writer(buf, self.parsed, record)
        return buf.getvalue()


def processor(batch: bool, **settings) -> IngestValidator:
    base = {"entity_field": "device_id", "time_field": "ts",
            "ranges": {"temperature": (-40.0, 200.0), "vibration": (0.0, 100.0)}, "dedup_window": 50,
            "max_record_bytes": 400}
    return IngestValidator(output_codec=Codec(batch), output_topic="ok", dlq_topic="dlq",
                           settings=IngestSettings.model_validate({**base, **settings}), clock=lambda: NOW / 1000)


def reading(rng: random.Random, i: int) -> dict:
    device = f"dev-{rng.randrange(5)}"
    return {"event_id": f"e-{i}", "device_id": device, "ts": NOW - rng.randrange(0, 60_000),
            "temperature": rng.choice([rng.uniform(20, 90), 61, None]), "vibration": rng.uniform(0, 5),
            "current": rng.uniform(10, 14), "pressure": None if i % 7 == 0 else rng.uniform(4, 6),
            "rpm": rng.uniform(1400, 1600)}


def spoil(rng: random.Random, r: dict) -> tuple[bytes | None, bytes | None]:
    """A key and value with one kind of defect (or none)."""
    kind = rng.choice(["ok"] * 6 + ["dup", "range", "type", "unknown", "missing", "json", "utf8", "key", "future",
                                    "old", "bool", "big", "none", "oversize", "optional"])
    key = r["device_id"].encode()
    if kind == "dup":
        r["event_id"] = f"e-{rng.randrange(0, 40)}"
    elif kind == "range":
        r["vibration"] = 1e6
    elif kind == "type":
        r["temperature"] = "hot"
    elif kind == "unknown":
        r["colour"] = "red"
    elif kind == "missing":
        del r["event_id"]
    elif kind == "json":
        return key, json.dumps(r).encode()[:-3]
    elif kind == "utf8":
        return key, b"\xff" + json.dumps(r).encode()
    elif kind == "key":
        key = b"dev-other"
    elif kind == "future":
        r["ts"] = NOW + 3_600_000
    elif kind == "old":
        r["ts"] = NOW - 86_400_000
    elif kind == "bool":
        r["rpm"] = True
    elif kind == "big":
        r["ts"] = 2**70
    elif kind == "none":
        return key, None
    elif kind == "oversize":
        r["event_id"] = "x" * 500
    elif kind == "optional":
        del r["rpm"]  # optional: accepted with its default, by the reading-at-a-time path
    return key, json.dumps(r).encode()


def batches(seed: int, clean: bool, n_batches: int = 30, size: int = 40) -> list[list[Record]]:
    rng = random.Random(seed)
    out, i = [], 0
    for b in range(n_batches):
        batch = []
        for _ in range(size):
            r = reading(rng, i)
            key, value = (r["device_id"].encode(), json.dumps(r).encode()) if clean else spoil(rng, r)
            headers = {"trace_id": b"%032x" % i} if i % 3 == 0 else {}
            batch.append(Record("raw", b % 3, i, key, value, headers, NOW - 5))
            i += 1
        out.append(batch)
    return out


def outputs(batch_path: bool, stream: list[list[Record]], **settings) -> tuple[list, IngestValidator]:
    p = processor(batch_path, **settings)
    admit_clean, p.taken = p.validator.admit_clean, 0

    def counted(*args):
        columns = admit_clean(*args)
        p.taken += columns is not None
        return columns

    p.validator.admit_clean = counted
    got = []
    for batch in stream:
        for out in p.process(batch):
            headers = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in out.headers.items()
                       if k != "dlq.failed_ms"}
            got.append((out.topic, out.key, out.value, headers))
    return got, p


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("settings", [{}, {"max_out_of_order_ms": 55_000}, {"dedup_window": 0}])
def test_batch_path_equals_reading_at_a_time(clean, settings):
    stream = batches(seed=3 if clean else 4, clean=clean)
    fast, p_fast = outputs(True, stream, **settings)
    slow, p_slow = outputs(False, stream, **settings)
    assert fast == slow
    assert list(p_fast.validator.memory.ids) == list(p_slow.validator.memory.ids)
    assert dict(p_fast.validator.memory.latest) == dict(p_slow.validator.memory.latest)
    accepted = sum(1 for o in fast if o[0] == "ok")
    assert p_slow.taken == 0
    if clean and not settings.get("max_out_of_order_ms"):
        assert accepted == sum(len(b) for b in stream) and p_fast.taken == len(stream)
    elif clean:  # readings up to 60 s apart per device: some are out of order, those batches go one by one
        assert 0 < p_fast.taken < len(stream)
    else:
        assert 0 < accepted < sum(len(b) for b in stream) and any(o[0] == "dlq" for o in fast)


def test_clean_batches_take_the_batch_path():
    p = processor(True)
    (batch,) = batches(seed=5, clean=True, n_batches=1)
    values = [r.value for r in batch]
    assert p.validator.admit_clean([r.key for r in batch], values, [NOW] * len(batch)) is not None
    # the same readings again: all duplicates now, so the batch path declines and remembers nothing new
    seen = list(p.validator.memory.ids)
    assert p.validator.admit_clean([r.key for r in batch], values, [NOW] * len(batch)) is None
    assert list(p.validator.memory.ids) == seen


def test_rate_limits_use_the_reading_at_a_time_path():
    p = processor(True, rate_limits={"per_device": {"rate_per_s": 1, "burst": 1}})
    (batch,) = batches(seed=6, clean=True, n_batches=1)
    assert p.validator.admit_clean([r.key for r in batch], [r.value for r in batch], [NOW] * len(batch)) is None
    reasons = [o.headers.get("dlq.reason") for o in p.process(batch)]
    assert "rate_limited" in reasons
