"""The Flink feature job on a real standalone cluster: a JobManager and a TaskManager started from the
Flink distribution the PyFlink wheel ships (``streams.flink.cluster``), the job submitted with
``flink run``, checkpoints on local disk. The TaskManager is killed (``kill -9``) mid-stream and a new one
started: the job restores from its checkpoint and every window comes out (at least once: a window
emitted after the last checkpoint comes out again, identical), nothing is lost, the late readings reach
the DLQ, and the online store holds each device's newest window."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import redis
from isolation import isolated_topology

from pm_app import FEATURE_SET
from pm_app.simulator import BASE_MS, recorded_readings
from reference import PM
from streams.avro import codec
from streams.features.layout import FeastLayout
from streams.features.online import read_online_features
from streams.flink.cluster import FlinkCluster, submit
from streams.plan import apply
from streams.testing import (
    by_window,
    count_records,
    diff_rows,
    expected_windows,
    partition_of,
    produce_records,
    read_rows,
)
from streams.topology import load_topology
from reference import load_schema

pytestmark = pytest.mark.integration

OFFSET = int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
PARTITIONS = 3


def _heartbeats(after_ms: int) -> list[dict]:
    """One reading per partition far ahead of the recording: every partition's watermark passes its windows."""
    out, n = [], 0
    while len(out) < PARTITIONS:
        device = f"heartbeat-{n}"
        if partition_of(device, PARTITIONS) not in {partition_of(r["device_id"], PARTITIONS) for r in out}:
            out.append({"event_id": f"{device}-0", "device_id": device, "ts": after_ms, "temperature": 1.0,
                        "vibration": 1.0, "current": 1.0, "pressure": 1.0, "rpm": 1.0})
        n += 1
    return out


def _wait(what: str, condition, timeout_s: float, cluster: FlinkCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for name, proc in cluster.procs.items():
            assert proc.poll() is None, f"flink {name} died; see {cluster.root / 'log'}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f}s; see {cluster.root / 'log'}"
        time.sleep(0.5)


def _flink_leftovers() -> set[str]:
    """What Flink's processes leave in the system's temporary folder when they cannot clean up (a TaskManager's
    working directory, the RPC jar each JVM extracts, the Python workers' and the file cache's folders, the
    client's zipped artifacts, the start scripts' pid files)."""
    patterns = ("tm_*", "flink-rpc-*.jar", "python-dist-*", "flink-dist-cache-*", "flink-distributed-cache-*",
                "flink-*.pid")
    return {path.name for pattern in patterns for path in Path(tempfile.gettempdir()).glob(pattern)}


def test_a_killed_taskmanager_is_replaced_and_the_job_restores_from_its_checkpoint_losing_nothing(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    apply(load_topology(path), stack)
    source, output, dlq = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window", f"{prefix}.dlq.features"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    out_codec = codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value"))
    readings = recorded_readings(9, 60.0, seed=3)
    stream = readings + _heartbeats(BASE_MS + 120_000)
    expected, expected_late = expected_windows(stream, FEATURE_SET, PARTITIONS)
    expected = {key: row for key, row in expected.items() if not key[0].startswith("heartbeat")}
    half = len(readings) // 2
    cluster = FlinkCluster(stack, rest_port=18091 + OFFSET, rpc_port=16123 + OFFSET)
    cluster.root.mkdir(parents=True, exist_ok=True)
    leftovers = _flink_leftovers()
    try:
        cluster.up()
        job = submit(stack, cluster.address, [
            "--bootstrap", stack.bootstrap_servers, "--registry", stack.registry_url, "--dlq", dlq,
            "--group", f"{prefix}.features-flink", "--source", source, "--output", output, "--table", f"{prefix}.devices",
            "--feature-set", str(PM / "features" / "device_window.yaml"), "--checkpoint-ms", "1000",
            "--redis", stack.redis_url, "--project", prefix,
        ], log_path=tmp_path / "submit.log")
        _wait("job running", lambda: any(j["jid"] == job and j["state"] == "RUNNING" for j in cluster.jobs()), 120,
              cluster)
        produce_records(stack.kafka, source, in_codec, readings[:half], key="device_id",
                        partitions=PARTITIONS)
        checkpoints = lambda: cluster.rest(f"/jobs/{job}/checkpoints")["counts"]  # noqa: E731
        _wait("windows out and a checkpoint after them", lambda: count_records(stack.kafka, output) >= 9 * 2
              and checkpoints()["completed"] >= 2, 180, cluster)
        cluster.kill("taskmanager-0")
        killed = list(cluster.tmp.glob("tm_*"))  # its working directory, which it could not remove
        cluster.start_taskmanager("taskmanager-1")
        produce_records(stack.kafka, source, in_codec, readings[half:] + _heartbeats(BASE_MS + 120_000),
                        key="device_id", partitions=PARTITIONS)
        _wait("every window out", lambda: len({(r["device_id"], r["window_start"]) for r in read_rows(
            stack.kafka, output, out_codec, idle_s=0.5)}) >= len(expected), 300, cluster)
        rows = by_window(read_rows(stack.kafka, output, out_codec, idle_s=2.0), key="device_id")
        restored = checkpoints()["restored"]
        late = {(headers["dlq.source_partition"], headers["dlq.source_offset"])
                for headers in (dict(m.headers()) for m in read_rows(stack.kafka, dlq, None, idle_s=2.0))}
    finally:
        cluster.down()
    assert killed and not cluster.tmp.exists()  # the cluster's temporary files went with it, the killed one's too
    assert _flink_leftovers() - leftovers == set()  # and none went to the system's temporary folder
    assert restored >= 1  # the job came back from a checkpoint, not from scratch
    assert diff_rows(expected, rows) == []  # every window, each identical however often it came out
    assert len(late) == expected_late > 0
    client = redis.Redis.from_url(stack.redis_url)
    try:
        devices = sorted({device for device, _ in expected})
        online = read_online_features(client, devices, FeastLayout.of(FEATURE_SET, prefix))
    finally:
        client.close()
    newest = {d: max(start for dd, start in expected if dd == d) for d in devices}
    assert [int(o["window_start"]) for o in online] == [newest[d] for d in devices]
