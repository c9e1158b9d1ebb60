"""Failures of the embedded feature worker and of its online store lose nothing.

- ``kill -9`` of the feature processor mid-window, twice, while readings stream in: after the
  restarts the emitted rows equal an uninterrupted computation (duplicates allowed, identical).
- Redis stopped while the processor runs, restarted later: the processor waits (offsets are not
  committed past the unwritten windows), catches up, and the online store ends with every
  device's newest window. This test runs its own Redis (ports 40400–40499), not the stack's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
from isolation import isolated_topology

from reference import REPO as PROJECT_ROOT
from streams.avro import codec
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
from reference import load_schema

pytestmark = pytest.mark.integration

OWN_REDIS_PORT = 40400 + int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0")) % 100


def _codecs(stack):
    return (codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value")),
            codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value")))


def _wait_for(kafka: KafkaConnection, topic: str, at_least: int, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while count_records(kafka, topic) < at_least:
        assert alive(), "the processor died"
        assert time.monotonic() < deadline, f"{topic}: fewer than {at_least} records after {timeout_s}s"
        time.sleep(0.3)


def test_kill_9_mid_window_then_restart_emits_what_an_uninterrupted_run_emits(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    apply(load_topology(path), stack)
    in_codec, out_codec = _codecs(stack)
    source, output = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window"
    readings = recorded_readings(12, 40.0, seed=21)
    expected, _ = expected_windows(readings, FEATURE_SET)
    log = (tmp_path / "features.log").open("ab")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "streams", "run", str(path), "features"], cwd=PROJECT_ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    chunks = [readings[i:i + len(readings) // 4 + 1] for i in range(0, len(readings), len(readings) // 4 + 1)]
    proc = start()
    try:
        for n, chunk in enumerate(chunks):
            produce_records(stack.kafka, source, in_codec, chunk, key="device_id")
            if n in (1, 2):  # mid-stream: windows are open, some emitted, offsets held back
                _wait_for(stack.kafka, output, 12 * (2 + 2 * (n - 1)), 60, lambda p=proc: p.poll() is None)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                proc = start()
        _wait_for(stack.kafka, output, len(expected), 90, lambda p=proc: p.poll() is None)
        rows = by_window(read_rows(stack.kafka, output, out_codec, idle_s=3.0), key="device_id")
    finally:
        proc.terminate()
        proc.wait(30)
    assert diff_rows(expected, rows) == []


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (AOF on), restartable on the same port and data."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (make setup installs it)"
    data = tmp_path / "redis"
    data.mkdir()
    procs: list[subprocess.Popen] = []

    def start() -> None:
        procs.append(subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(OWN_REDIS_PORT), "--dir", str(data),
                                       "--appendonly", "yes", "--save", "", "--daemonize", "no"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        client = redis.Redis(port=OWN_REDIS_PORT, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "own redis did not start"
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


def test_redis_restarted_while_the_job_runs_waits_and_catches_up(stack, tmp_path, own_redis):
    start_redis, stop_redis = own_redis
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    in_codec, out_codec = _codecs(stack)
    source, output = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window"
    readings = recorded_readings(8, 40.0, seed=33)
    expected, _ = expected_windows(readings, FEATURE_SET)
    half = len(readings) // 2
    runner = make_runner(topology, "features", stack.model_copy(update={"redis_port": OWN_REDIS_PORT}))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        produce_records(stack.kafka, source, in_codec, readings[:half], key="device_id")
        _wait_for(stack.kafka, output, 8 * 3, 60, thread.is_alive)
        stop_redis()
        produce_records(stack.kafka, source, in_codec, readings[half:], key="device_id")
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
