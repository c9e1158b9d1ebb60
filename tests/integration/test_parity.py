"""Training/serving parity across engines: the same recorded input through the embedded engine, the
Faust job and the Flink SQL job (local mini-cluster, bounded) yields identical rows — same keys, same
window bounds and counts, values equal within 1e-9 relative — and the same late readings in the DLQ.
The stream ends: the embedded engine closes the last windows when its partitions go quiet, the bounded
Flink job at the end of its input; the Faust job (no idle timeout) is compared on the windows the
stream's own time closed.

The recording has disorder, stragglers, late readings, dropped values, two devices with skewed
clocks and values no engine can decode (each to the DLQ as it came, reason undecodable); every engine
closes windows by the stream time of their partition, so the skew decides the same late readings
everywhere."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from confluent_kafka import Producer
from isolation import isolated_topology

from reference import REPO as PROJECT_ROOT
from streams.avro import codec
from streams.features.layout import FeastLayout
from pm_app import FEATURE_SET
from reference import PM
from streams.features import faust_job
from streams.features.online import read_online_features
from pm_app.simulator import recorded_readings
from streams.testing import (
    by_window,
    count_records,
    create_topics,
    diff_rows,
    expected_windows,
    partition_of,
    produce_records,
    read_rows,
)
from streams.flink.launcher import job_argv, run_job
from streams.plan import apply
from streams.run import make_runner
from streams.topology import load_topology
from reference import load_schema

pytestmark = pytest.mark.integration

FEATURE_SET_FILE = PM / "features" / "device_window.yaml"


PARTITIONS = 3
#: Two devices with skewed clocks, in different partitions: one 3 s ahead (it moves its partition's stream
#: time on, so the other devices there see their windows close earlier) and one 3 s behind (the last 2 s
#: of each of its windows arrive after the partition's time passed them: late).
SKEW_MS = {"dev-00003": 3000, "dev-00004": -3000}


def _skewed(reading: dict) -> dict:
    return {**reading, "ts": reading["ts"] + SKEW_MS.get(reading["device_id"], 0)}


def undecodable(framed: bytes) -> list[tuple[bytes, bytes]]:
    """Values no engine can read, keyed by devices of the recording, one of each kind: not Confluent-framed, a
    framed body cut short, a framed body under a schema id the registry does not know."""
    unknown_id = (2**31 - 1).to_bytes(4, "big")
    return [(b"dev-00000", b"not avro at all"), (b"dev-00001", framed[:8]),
            (b"dev-00002", b"\x00" + unknown_id + framed[5:])]


def produce_raw(stack, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers})
    for key, value in records:
        producer.produce(topic, value, key, partition=partition_of(key.decode(), PARTITIONS))
    assert producer.flush(30) == 0


@pytest.fixture(scope="module")
def recorded(stack, tmp_path_factory):
    """An isolated topology with 20 devices × 30 s of disordered telemetry on its ingest topic."""
    tmp = tmp_path_factory.mktemp("parity")
    path, prefix = isolated_topology(tmp)
    # the stream ends: once quiet for 2 s the embedded engine closes every window, as a bounded Flink job
    # does at the end of its input
    path.write_text(path.read_text().replace("feature_set: features/device_window.yaml\n",
                                             "feature_set: features/device_window.yaml\n      idle_partition_s: 2\n", 1))
    topology = load_topology(path)
    apply(topology, stack)
    source = f"{prefix}.ingest.telemetry"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    out_codec = codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value"))
    readings = [_skewed(r) for r in recorded_readings(20, 30.0)]
    produce_records(stack.kafka, source, in_codec, readings, key="device_id", partitions=PARTITIONS)
    garbage = undecodable(in_codec.encode(readings[0]))
    produce_raw(stack, source, garbage)
    return {"tmp": tmp, "path": path, "prefix": prefix, "topology": topology, "source": source,
            "readings": readings, "undecodable": len(garbage), "out_codec": out_codec,
            "closed": expected_windows(readings, FEATURE_SET, PARTITIONS),  # by the stream's own time
            "all": expected_windows(readings, FEATURE_SET, PARTITIONS, quiet=True)}  # and at its end


@pytest.fixture(scope="module")
def embedded_rows(stack, recorded):
    runner = make_runner(recorded["topology"], "features", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        rows = read_rows(stack.kafka, f"{recorded['prefix']}.features.device_window",
                         recorded["out_codec"], count=len(recorded["all"][0]), idle_s=10.0)
    finally:
        runner.stop()
        thread.join(30)
    late = count_records(stack.kafka, f"{recorded['prefix']}.dlq.features")
    return by_window(rows, key="device_id"), late


@pytest.fixture(scope="module")
def flink_rows(stack, recorded):
    prefix = recorded["prefix"]
    output, dlq = f"{prefix}.features.device_window_flink", f"{prefix}.dlq.features_flink"
    create_topics(stack.kafka, [output, dlq])
    argv = job_argv(stack, feature_set=str(FEATURE_SET_FILE), dlq=dlq, group=f"{prefix}.features-flink",
                    source=recorded["source"], output=output, table=f"{prefix}.devices",
                    bounded=True, online_project=f"{prefix}-flink")
    run_job(argv, timeout_s=300, log_path=Path(recorded["tmp"]) / "flink.log", settings=stack)
    rows = read_rows(stack.kafka, output, recorded["out_codec"], idle_s=1.0)
    return by_window(rows, key="device_id"), count_records(stack.kafka, dlq)


def run_faust_job(stack, log_path: Path, want: dict[str, int], timeout_s: float = 120.0, **options: str) -> None:
    """Run a worker of the Faust job (``faust_job.command`` on ``stack`` with ``options``) until every topic of
    ``want`` holds at least its number of records, or ``timeout_s``, then stop it; its output goes to ``log_path``,
    whose tail a failure shows if it dies first."""
    argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                             redis_url=stack.redis_url, **options)
    with log_path.open("wb") as log:
        worker = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while any(count_records(stack.kafka, topic) < n for topic, n in want.items()) \
                    and time.monotonic() < deadline:
                assert worker.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.5)
        finally:
            worker.terminate()
            worker.wait(30)


@pytest.fixture(scope="module")
def faust_rows(stack, recorded, embedded_rows):
    prefix = recorded["prefix"]
    output, dlq = f"{prefix}.features.device_window_faust", f"{prefix}.dlq.features_faust"
    create_topics(stack.kafka, [output, dlq])
    run_faust_job(stack, Path(recorded["tmp"]) / "faust.log", {output: len(recorded["closed"][0]), dlq: embedded_rows[1]},
                  project=f"{prefix}-faust", source=recorded["source"], output=output, dlq=dlq,
                  group=f"{prefix}.features-faust", feature_set=str(FEATURE_SET_FILE),
                  table=f"{prefix}.devices")  # the isolated topology's table, when the feature set joins one
    rows = read_rows(stack.kafka, output, recorded["out_codec"], idle_s=2.0)
    return by_window(rows, key="device_id"), count_records(stack.kafka, dlq)


def test_embedded_engine_matches_a_numpy_reference_with_disorder_skew_and_late_readings(recorded, embedded_rows):
    rows, late = embedded_rows
    expected, expected_late = recorded["all"]
    assert len(rows) == len(expected) > len(recorded["closed"][0]) >= 20 * 4
    assert diff_rows(expected, rows) == []
    assert late == expected_late + recorded["undecodable"]  # the DLQ: late readings and undecodable values
    assert expected_late > sum(1 for r in recorded["readings"] if "-l" in r["event_id"]) > 0
    assert partition_of("dev-00003", PARTITIONS) != partition_of("dev-00004", PARTITIONS)
    assert any(device == "dev-00004" for device, _ in rows)  # the lagging device still has windows


def test_flink_job_rows_equal_the_embedded_engine_rows(recorded, embedded_rows, flink_rows):
    (embedded, embedded_late), (flink, flink_late) = embedded_rows, flink_rows
    assert len(embedded) == len(recorded["all"][0])
    assert diff_rows(embedded, flink, rel=1e-9) == []
    assert flink_late == embedded_late > 0


def test_faust_job_rows_equal_the_embedded_engine_rows(recorded, embedded_rows, faust_rows):
    (embedded, embedded_late), (faust, faust_late) = embedded_rows, faust_rows
    # the Faust job has no idle timeout: it emits the windows the stream's own time closed
    closed = {key: row for key, row in embedded.items() if key in recorded["closed"][0]}
    assert diff_rows(closed, faust, rel=1e-9) == []
    assert faust_late == embedded_late > 0


@pytest.mark.parametrize("engine", ["embedded", "faust", "flink"])
def test_every_engine_writes_its_newest_rows_to_feasts_online_store(stack, recorded, engine, request):
    """Each engine wrote the newest window of every device to Feast's Redis layout (its own project here)."""
    rows, _ = request.getfixturevalue(f"{engine}_rows")
    project = recorded["prefix"] if engine == "embedded" else f"{recorded['prefix']}-{engine}"
    layout = FeastLayout.of(FEATURE_SET, project)
    newest = {}
    for (device, start), row in rows.items():
        if device not in newest or start > newest[device]["window_start"]:
            newest[device] = row
    devices = sorted(newest)
    client = redis.Redis.from_url(stack.redis_url)
    try:
        online = read_online_features(client, devices, layout)
    finally:
        client.close()
    assert len(devices) == 20
    for device, served in zip(devices, online, strict=True):
        expected = {k: v for k, v in newest[device].items() if k != "device_id"}
        assert served.keys() == expected.keys(), device
        assert all(served[k] == v or (math.isnan(served[k]) and math.isnan(v)) for k, v in expected.items()), device


def test_flink_dead_letters_carry_the_original_bytes_and_the_reason(stack, recorded, embedded_rows, flink_rows):
    """The Flink job's DLQ holds the same records as the embedded engine's: the original bytes, the reason (late
    or undecodable), the source position in the headers."""
    prefix = recorded["prefix"]

    def letters(topic: str) -> dict[tuple[bytes, bytes], tuple[bytes, bytes]]:
        out = {}
        for message in read_rows(stack.kafka, topic, None, idle_s=2.0):
            headers = dict(message.headers())
            out[(headers["dlq.source_partition"], headers["dlq.source_offset"])] = (message.value(),
                                                                                  headers["dlq.reason"])
        return out

    embedded, flink = letters(f"{prefix}.dlq.features"), letters(f"{prefix}.dlq.features_flink")
    assert len(embedded) == embedded_rows[1] > 0
    assert flink == embedded
    reasons = collections.Counter(reason for _, reason in flink.values())
    assert reasons[b"undecodable"] == recorded["undecodable"] and reasons[b"late"] > 0
