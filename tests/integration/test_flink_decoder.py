"""``CONFLUENT_AVRO``, the Flink job's decoder, against Flink's own avro-confluent deserializer on the same values.

A writer schema of primitive fields is read by ``FlatRecordDecoder`` (straight into the row): Avro's promotions,
null on either side of a union, fields the row does not take, text that is not ASCII. Any other writer schema (a
nested record, an array) goes through Flink's deserializer. Values neither can read decode to NULL on both. The
check runs ``tests/integration/flink/DecoderParity.java`` against the job's jars and the stack's registry."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from reference import REPO
from streams.avro import codec
from streams.flink.launcher import fetch_jars, flink_python

pytestmark = pytest.mark.integration

ROW = "ROW<`id` STRING, `ts` BIGINT, `a` DOUBLE, `b` DOUBLE, `c` FLOAT, `n` INT, `ok` BOOLEAN>"

FLAT = {"type": "record", "name": "Flat", "namespace": "test.decoder", "fields": [
    {"name": "note", "type": "string"},  # not in the row: skipped
    {"name": "id", "type": "string"},
    {"name": "blob", "type": ["null", "bytes"]},  # skipped
    {"name": "ts", "type": "int"},  # int → BIGINT
    {"name": "a", "type": ["double", "null"]},  # null the second branch
    {"name": "b", "type": ["null", "float"]},  # float → DOUBLE
    {"name": "c", "type": "long"},  # long → FLOAT
    {"name": "n", "type": ["null", "int"]},
    {"name": "ok", "type": "boolean"},
    {"name": "extra", "type": ["null", "long"]},  # skipped
]}

NESTED = {"type": "record", "name": "Nested", "namespace": "test.decoder", "fields": [
    {"name": "id", "type": "string"},
    {"name": "where", "type": {"type": "record", "name": "Where", "fields": [{"name": "x", "type": "double"}]}},
    {"name": "ts", "type": "long"},
    {"name": "tags", "type": {"type": "array", "items": "string"}},
    {"name": "a", "type": ["null", "double"]},
    {"name": "b", "type": "double"},
    {"name": "c", "type": "float"},
    {"name": "n", "type": "int"},
    {"name": "ok", "type": "boolean"},
]}


def flat_records(n: int) -> list[dict]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        maybe = lambda value: None if rng.random() < 0.25 else value  # noqa: E731
        out.append({"note": "x" * int(rng.integers(0, 40)), "id": f"dev-{i:03d}-ü€😀" if i % 3 == 0 else f"dev-{i:03d}",
                    "blob": maybe(bytes(rng.integers(0, 256, int(rng.integers(0, 9))).astype(np.uint8))),
                    "ts": int(rng.integers(-2**31, 2**31 - 1)), "a": maybe(float(rng.normal() * 1e6)),
                    "b": maybe(float(np.float32(rng.normal()))), "c": int(rng.integers(-2**62, 2**62)),
                    "n": maybe(int(rng.integers(-2**31, 2**31 - 1))), "ok": bool(i % 2), "extra": maybe(i * 2**40)})
    return out


def nested_records(n: int) -> list[dict]:
    return [{"id": f"dev-{i}", "where": {"x": i / 7}, "ts": 1_700_000_000_000 + i, "tags": ["a", "b"][: i % 3],
             "a": None if i % 2 else i * 0.5, "b": -i / 3, "c": i / 9, "n": i, "ok": i % 2 == 0} for i in range(n)]


def _classpath(stack) -> str:
    """The job's jars (the function's, the Kafka connector, the avro-confluent format) and Flink's own."""
    pyflink = subprocess.run([str(flink_python()), "-c", "import os, pyflink; print(os.path.dirname(pyflink.__file__))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return ":".join([*(str(jar) for jar in fetch_jars(stack)), f"{pyflink}/lib/*"])


def test_the_flat_reader_gives_flinks_rows_and_other_schemas_go_to_flinks_deserializer(stack, tmp_path):
    java, javac = shutil.which("java"), shutil.which("javac")
    assert java and javac, "a JDK (java, javac) is needed: make setup installs it"
    classpath = _classpath(stack)
    compiled = subprocess.run([javac, "-d", str(tmp_path), "-cp", classpath,
                               str(REPO / "tests" / "integration" / "flink" / "DecoderParity.java")],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]

    flat = codec(stack.registry_url, "test.decoder.flat-value", FLAT, register=True)
    nested = codec(stack.registry_url, "test.decoder.nested-value", NESTED, register=True)
    flat_values = [flat.encode(r) for r in flat_records(300)]
    nested_values = [nested.encode(r) for r in nested_records(30)]
    unknown_id = b"\x00" + (2**31 - 1).to_bytes(4, "big") + flat_values[0][5:]
    bad_branch = flat_values[0][:5] + b"\x02x\x02i\x0a"  # note "x", id "i", then union branch 5 of two
    bad = [b"not avro at all", flat_values[1][:8], unknown_id, bad_branch, b"\x00\x00"]
    values = flat_values + nested_values + bad

    run = subprocess.run([java, "-cp", f"{tmp_path}:{classpath}", "dev.tangram.flink.DecoderParity", ROW,
                          stack.registry_url], input="\n".join(v.hex() for v in values) + "\n",
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split("\t") for line in run.stdout.splitlines()]
    assert len(lines) == len(values)
    assert [function for _, function, _ in lines] == [flink for _, _, flink in lines]  # row for row, as Flink reads them

    readers = [reader for reader, _, _ in lines]
    flat_rows = lines[: len(flat_values)]
    assert readers[: len(flat_values)] == ["flat"] * len(flat_values)
    assert readers[len(flat_values): len(flat_values) + len(nested_values)] == ["flink"] * len(nested_values)
    assert all(row != "null" for _, row, _ in lines[: len(flat_values) + len(nested_values)])
    assert [row for _, row, _ in lines[-len(bad):]] == ["null"] * len(bad)
    assert any("ü€😀" in row for _, row, _ in flat_rows) and any(",null," in row for _, row, _ in flat_rows)
