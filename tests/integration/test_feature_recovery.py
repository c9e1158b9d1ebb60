"""Failures of the embedded feature worker, of the Faust job and of their online store lose nothing.

- ``kill -9`` of the feature processor mid-window, twice, while readings stream in: after the
  restarts the emitted rows equal an uninterrupted computation (duplicates allowed, identical).
- ``kill -9`` of the Faust job mid-stream: its table comes back from the changelog, the rows equal the
  reference's.
- Redis stopped while the processor runs, restarted later: the processor waits (offsets are not
  committed past the unwritten windows), catches up, and the online store ends with every
  device's newest window. This test runs its own Redis (ports 28400–28499, below the kernel's ephemeral range, where a client's
  own port could take it first), not the stack's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import redis
from isolation import isolated_topology

from reference import REPO as PROJECT_ROOT
from streams.avro import codec
from streams.features import faust_job
from streams.features.engine import online_layout
from streams.features.online import read_online_features
from pm_app import FEATURE_SET
from pm_app.simulator import recorded_readings
from streams.testing import (
    by_window,
    count_records,
    diff_rows,
    expected_windows,
    produce_records,
    read_rows,
)
from streams.plan import apply
from streams.security.kafka import KafkaConnection
from streams.run import make_runner
from streams.topology import load_topology
from reference import PM, load_schema

pytestmark = pytest.mark.integration

FEATURE_SET_FILE = PM / "features" / "device_window.yaml"

OWN_REDIS_PORT = 28400 + int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0")) % 100


def _codecs(stack):
    return (codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value")),
            codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value")))


def _wait_for(kafka: KafkaConnection, topic: str, at_least: int, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while count_records(kafka, topic) < at_least:
        assert alive(), "the processor died"
        assert time.monotonic() < deadline, f"{topic}: fewer than {at_least} records after {timeout_s}s"
        time.sleep(0.3)


def _metric(port: int, name: str) -> float:
    """A counter of the processor serving metrics on ``port`` (0 when it has no sample yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:  # noqa: S310 - the test's own
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_kill_9_mid_window_then_restart_emits_what_an_uninterrupted_run_emits(stack, tmp_path):
    """Killed twice mid-stream: the rows equal an uninterrupted run's, and the readings read again after each
    restart are rebuilt or counted as re-reads — the DLQ holds exactly the late readings, no false ones."""
    path, prefix = isolated_topology(tmp_path)
    apply(load_topology(path), stack)
    in_codec, out_codec = _codecs(stack)
    source, output, dlq = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window", f"{prefix}.dlq.features"
    readings = recorded_readings(12, 40.0, seed=21)
    expected, expected_late = expected_windows(readings, FEATURE_SET, 3)
    log = (tmp_path / "features.log").open("ab")
    port = _free_port()

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "streams", "run", str(path), "features", "--metrics-port",
                                 str(port)], cwd=PROJECT_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    chunks = [readings[i:i + len(readings) // 4 + 1] for i in range(0, len(readings), len(readings) // 4 + 1)]
    proc = start()
    try:
        for n, chunk in enumerate(chunks):
            produce_records(stack.kafka, source, in_codec, chunk, key="device_id", partitions=3)
            if n in (1, 2):  # mid-stream: windows are open, some emitted, offsets held back
                _wait_for(stack.kafka, output, 12 * (2 + 2 * (n - 1)), 60, lambda p=proc: p.poll() is None)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                proc = start()
        _wait_for(stack.kafka, output, len(expected), 90, lambda p=proc: p.poll() is None)
        rows = by_window(read_rows(stack.kafka, output, out_codec, idle_s=3.0), key="device_id")
        rebuilt = _metric(port, "tangram_features_rebuild_records_total")
        reread = _metric(port, "tangram_features_reread_records_total")
    finally:
        proc.terminate()
        proc.wait(30)
    assert sum(map(len, chunks)) == len(readings) and len(rows) == len(expected)
    assert diff_rows(expected, rows) == []
    # every late reading dead-lettered (a batch acknowledged just before a kill may send its dead letters twice:
    # count each source position once), and nothing else: the re-reads are not there
    dead = read_rows(stack.kafka, dlq, None, idle_s=2.0)
    late = {_position(m) for m in dead}
    assert len(late) == expected_late > 0, _explain(late, tmp_path / "features.log", dead)
    # the last restart re-read what its committed offsets held back: bounded by the open windows (5 s + 1 s of
    # event time of 12 devices at 10 Hz, with the disorder of the recording) and one batch, not the stream
    assert 0 < rebuilt <= 12 * 10 * 8 + 500, rebuilt
    assert reread <= rebuilt


@pytest.mark.parametrize("batch_size", [2000, 40])
def test_a_quiet_partition_closes_its_windows_and_what_a_restart_reads_again_of_them_are_rereads(stack, tmp_path,
                                                                                                 batch_size):
    """The stream stops: after ``idle_partition_s`` every open window is closed and emitted (the rows equal the
    reference's with the partitions gone quiet). The committed offsets still stand at those windows' first
    readings (a quiet partition brings no batch to commit with), so a ``kill -9`` and restart reads them
    again: all of them re-reads, none dead-lettered, no window emitted again with other values. At a batch of
    40 the restart reads them again in several batches each (about 120 readings a partition): every one of
    those batches stays a re-read up to the recorded mark (17fadd9: before it, the second batch's readings of
    the closed windows went to the DLQ as late)."""
    path, prefix = isolated_topology(tmp_path)
    text = path.read_text().replace("feature_set: features/device_window.yaml\n",
                                    "feature_set: features/device_window.yaml\n      idle_partition_s: 2\n", 1)
    path.write_text(text.replace("    batch_size: 2000\n", f"    batch_size: {batch_size}\n", 1))
    topology = load_topology(path)
    assert topology.processors["features"].params["idle_partition_s"] == 2
    assert topology.processors["features"].batch_size == batch_size
    apply(topology, stack)
    in_codec, out_codec = _codecs(stack)
    source, output, dlq = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window", f"{prefix}.dlq.features"
    readings = recorded_readings(6, 22.0, seed=5)
    expected, expected_late = expected_windows(readings, FEATURE_SET, 3, quiet=True)
    still_open = len(expected) - len(expected_windows(readings, FEATURE_SET, 3)[0])
    assert still_open >= 6  # the last window of each device closes only because its partition went quiet
    log = (tmp_path / "features.log").open("ab")
    port = _free_port()

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "streams", "run", str(path), "features", "--metrics-port",
                                 str(port)], cwd=PROJECT_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    proc = start()
    try:
        produce_records(stack.kafka, source, in_codec, readings, key="device_id", partitions=3)
        _wait_for(stack.kafka, output, len(expected), 90, lambda p=proc: p.poll() is None)
        assert _metric(port, "tangram_features_idle_closed_windows_total") == still_open
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = start()
        deadline, seen = time.monotonic() + 60, (-1.0, time.monotonic())
        while True:  # until the restart has read again what the quiet partitions held, and nothing more comes
            assert proc.poll() is None and time.monotonic() < deadline, "the restarted processor did not settle"
            try:
                reread = _metric(port, "tangram_features_reread_records_total")
            except OSError:
                reread = -1.0  # not serving yet
            if reread != seen[0]:
                seen = (reread, time.monotonic())
            elif reread > 0 and time.monotonic() - seen[1] > 3:
                break
            time.sleep(0.3)
        rebuilt = _metric(port, "tangram_features_rebuild_records_total")
        rows = by_window(read_rows(stack.kafka, output, out_codec, idle_s=3.0), key="device_id")
    finally:
        proc.terminate()
        proc.wait(30)
    assert diff_rows(expected, rows) == []
    assert 0 < reread == rebuilt <= 6 * 10 * 8 + 500  # every reading read again was of a closed window
    dead = read_rows(stack.kafka, dlq, None, idle_s=2.0)
    late = {_position(m) for m in dead}
    assert len(late) == expected_late, _explain(late, tmp_path / "features.log", dead)


def _explain(late: set[tuple[bytes, bytes]], log, dead: list) -> str:
    """What a failed dead-letter count needs to be understood after the run's files are gone: the dead-lettered
    offsets of each partition (first, last, how many), when each run wrote its dead letters (``dlq.failed_ms``
    against the log's start times), a few of them, and the processor's log."""
    spans = {}
    for partition, offset in late:
        spans.setdefault(partition.decode(), []).append(int(offset))
    where = {p: (min(o), max(o), len(o)) for p, o in sorted(spans.items())}
    written = sorted((int(h["dlq.failed_ms"]), h["dlq.source_partition"].decode(), int(h["dlq.source_offset"]),
                      h["dlq.error_message"].decode(errors="replace"))
                     for h in (dict(m.headers()) for m in dead))
    samples = "\n".join(f"  {ms} p{p}@{o}: {why}" for ms, p, o, why in written[:: max(1, len(written) // 12)])
    return (f"dead-lettered (first, last, count) per partition: {where}\ndead letters written (failed_ms, position, "
            f"message), a sample of {len(written)}:\n{samples}\n{log.read_text(errors='replace')[-6000:]}")


def _position(message) -> tuple[bytes, bytes]:
    headers = dict(message.headers())
    assert headers["dlq.reason"] == b"late", headers["dlq.reason"]
    return headers["dlq.source_partition"], headers["dlq.source_offset"]


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (AOF on), restartable on the same port and data."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (make setup installs it)"
    data = tmp_path / "redis"
    data.mkdir()
    procs: list[subprocess.Popen] = []

    def start() -> None:
        log = tmp_path / "redis.log"
        procs.append(subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(OWN_REDIS_PORT), "--dir", str(data),
                                       "--appendonly", "yes", "--save", "", "--daemonize", "no"],
                                      stdout=log.open("ab"), stderr=subprocess.STDOUT))
        client = redis.Redis(port=OWN_REDIS_PORT, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                exited = procs[-1].poll() is not None
                assert not exited and time.monotonic() < deadline, (
                    f"own redis on port {OWN_REDIS_PORT} did not start ({'it exited' if exited else 'no answer in 10 s'}):\n"
                    f"{log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)

    def stop() -> None:
        procs[-1].terminate()
        procs[-1].wait(10)

    start()
    yield start, stop
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(10)


def test_faust_job_killed_mid_window_restores_its_table_and_emits_what_an_uninterrupted_run_emits(stack, tmp_path):
    """The Faust job, ``kill -9`` mid-stream and restarted: its table (a key per partition's clock, one per
    entity's open windows) comes back from the changelog, and the rows equal the reference's (by the
    partitions' own time: the Faust job has no idle timeout); no reading counted twice, none lost."""
    path, prefix = isolated_topology(tmp_path)
    apply(load_topology(path), stack)
    in_codec, out_codec = _codecs(stack)
    source, output, dlq = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window", f"{prefix}.dlq.features"
    readings = recorded_readings(8, 30.0, seed=23)
    expected, expected_late = expected_windows(readings, FEATURE_SET, 3)
    argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                             redis_url=stack.redis_url, project=f"{prefix}-faust", source=source, output=output,
                             dlq=dlq, group=f"{prefix}.features-faust", feature_set=str(FEATURE_SET_FILE),
                             table=f"{prefix}.devices")
    log = (tmp_path / "faust.log").open("ab")

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    half = len(readings) // 2
    proc = start()
    try:
        produce_records(stack.kafka, source, in_codec, readings[:half], key="device_id", partitions=3)
        _wait_for(stack.kafka, output, 8 * 2, 120, lambda p=proc: p.poll() is None)
        time.sleep(1.0)  # mid-stream, some windows out, others open
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = start()
        produce_records(stack.kafka, source, in_codec, readings[half:], key="device_id", partitions=3)
        _wait_for(stack.kafka, output, len(expected), 150, lambda p=proc: p.poll() is None)
        rows = by_window(read_rows(stack.kafka, output, out_codec, idle_s=3.0), key="device_id")
    finally:
        proc.terminate()
        proc.wait(30)
    assert len(rows) == len(expected)
    assert diff_rows(expected, rows) == []
    dead = read_rows(stack.kafka, dlq, None, idle_s=2.0)
    late = {_position(m) for m in dead}
    assert len(late) == expected_late > 0, _explain(late, tmp_path / "features.log", dead)


def test_redis_restarted_while_the_job_runs_waits_and_catches_up(stack, tmp_path, own_redis):
    start_redis, stop_redis = own_redis
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    in_codec, out_codec = _codecs(stack)
    source, output = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window"
    readings = recorded_readings(8, 40.0, seed=33)
    expected, _ = expected_windows(readings, FEATURE_SET, 3)
    half = len(readings) // 2
    runner = make_runner(topology, "features", stack.model_copy(update={"redis_port": OWN_REDIS_PORT}))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        produce_records(stack.kafka, source, in_codec, readings[:half], key="device_id", partitions=3)
        _wait_for(stack.kafka, output, 8 * 3, 60, thread.is_alive)
        stop_redis()
        produce_records(stack.kafka, source, in_codec, readings[half:], key="device_id", partitions=3)
        time.sleep(4.0)  # the processor is stuck in its online-store write, retrying
        assert thread.is_alive()
        start_redis()
        _wait_for(stack.kafka, output, len(expected), 60, thread.is_alive)
        rows = by_window(read_rows(stack.kafka, output, out_codec, idle_s=3.0), key="device_id")
        time.sleep(1.0)
    finally:
        runner.stop()
        thread.join(30)
    assert diff_rows(expected, rows) == []
    assert runner.processor.store.retries > 0
    client = redis.Redis(port=OWN_REDIS_PORT)
    devices = sorted({d for d, _ in expected})
    online = read_online_features(client, devices, online_layout(topology))
    newest = {d: max(s for dd, s in expected if dd == d) for d in devices}
    assert [int(o["window_start"]) for o in online] == [newest[d] for d in devices]
    client.close()
