"""The online store is Feast's: what the embedded engine writes, Feast's own SDK reads, with no bridge.

An isolated topology (its app is the Feast project) is registered with Feast (``python -m
streams.feast apply`` in ``.venv-feast``); the embedded feature engine, run by the delivery loop
on recorded telemetry, writes its rows to Redis; then Feast's ``FeatureStore.get_online_features``
(``python -m streams.feast get``, Feast's environment, a subprocess) returns for every device
exactly the newest row the engine emitted on the features topic, and so does the application's
own lookup (``read_online_features``). Nothing ran ``sync``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time

import pytest
import redis
from isolation import isolated_topology

from reference import REPO as PROJECT_ROOT
from streams.avro import codec
from pm_app import FEATURE_SET
from streams.features import online_layout, read_online_features
from pm_app.simulator import recorded_readings
from streams.testing import count_records, expected_windows, produce_records, read_rows
from streams.plan import apply
from streams.run import make_runner
from streams.topology import load_topology
from reference import load_schema

pytestmark = pytest.mark.integration

FEAST_PYTHON = PROJECT_ROOT / ".venv-feast" / "bin" / "python"
FEATURE_SET_FILE = PROJECT_ROOT / "topologies" / "predictive_maintenance" / "features" / "device_window.yaml"


def _feast(*args: str, timeout: float = 180) -> str:
    assert FEAST_PYTHON.exists(), f"{FEAST_PYTHON} is missing: run `make setup` (it creates the Feast environment)"
    proc = subprocess.run([str(FEAST_PYTHON), "-m", "streams.feast", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout.splitlines()[-1]


def _same(a, b) -> bool:
    if isinstance(b, str):
        return a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == pytest.approx(b, rel=1e-12, abs=0.0)


def test_feast_reads_what_the_embedded_engine_wrote(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    layout = online_layout(topology)
    assert layout.project == topology.app == prefix

    # 1. Feast's repository for the same feature set and project, on the stack's Redis.
    redis_host = stack.redis_host or stack.host
    applied = json.loads(_feast("apply", "--home", str(tmp_path), "--project", prefix, "--feature-set", str(FEATURE_SET_FILE),
                                "--redis", f"{redis_host}:{stack.redis_port}"))
    assert "FeatureView device_window" in applied["applied"]

    # 2. The embedded engine computes windows of recorded telemetry and writes the online store.
    readings = recorded_readings(6, 16.0, seed=11)
    expected, _ = expected_windows(readings, FEATURE_SET)
    source, output = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    out_codec = codec(stack.registry_url, "pm.features.device_window-value",
                      load_schema("pm.features.device_window-value"))
    produce_records(stack.kafka, source, in_codec, readings, key="device_id")
    runner = make_runner(topology, "features", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while count_records(stack.kafka, output) < len(expected):
            assert thread.is_alive(), "the feature processor died"
            assert time.monotonic() < deadline, f"fewer than {len(expected)} windows after 90 s"
            time.sleep(0.3)
        rows = read_rows(stack.kafka, output, out_codec, idle_s=1.0)
    finally:
        runner.stop()
        thread.join(30)
    assert runner.processor.store.written > 0
    newest: dict[str, dict] = {}
    for row in rows:
        if row["device_id"] not in newest or row["window_end"] > newest[row["device_id"]]["window_end"]:
            newest[row["device_id"]] = row
    devices = sorted(newest)
    assert len(devices) == 6

    # 3. Feast's own SDK reads exactly those rows (and nothing for an unknown device).
    got = json.loads(_feast("get", "--home", str(tmp_path), "--feature-set", str(FEATURE_SET_FILE), *devices, "no-such-device"))
    for device, read in zip(devices, got, strict=False):
        assert read["device_id"] == device
        assert set(read) == set(FEATURE_SET.columns)
        wrong = {c: (read[c], newest[device][c]) for c in FEATURE_SET.columns if not _same(read[c], newest[device][c])}
        assert not wrong, (device, wrong)
    assert all(got[-1][c] is None for c in FEATURE_SET.columns if c != "device_id")

    # 4. The application's lookup reads the same bytes, and the keys carry the declared TTL.
    client = redis.Redis.from_url(stack.redis_url)
    try:
        ours = read_online_features(client, devices, layout)
        for device, read in zip(devices, ours, strict=True):
            assert all(_same(read[c], newest[device][c]) for c in FEATURE_SET.columns if c != "device_id"), device
        assert all(0 < client.ttl(layout.key(d)) <= FEATURE_SET.online.ttl_s for d in devices)
    finally:
        client.close()
