"""Training/serving parity across engines: the same recorded input through the embedded engine, the
Faust job and the PyFlink job (local mini-cluster) yields identical rows — same keys, same window
bounds and counts, values equal within 1e-9 relative — and the same late readings in the DLQ."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
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


@pytest.fixture(scope="module")
def recorded(stack, tmp_path_factory):
    """An isolated topology with 20 devices × 30 s of disordered telemetry on its ingest topic."""
    tmp = tmp_path_factory.mktemp("parity")
    path, prefix = isolated_topology(tmp)
    topology = load_topology(path)
    apply(topology, stack)
    source = f"{prefix}.ingest.telemetry"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    out_codec = codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value"))
    readings = recorded_readings(20, 30.0)
    produce_records(stack.kafka, source, in_codec, readings, key="device_id")
    return {"tmp": tmp, "path": path, "prefix": prefix, "topology": topology, "source": source,
            "readings": readings, "out_codec": out_codec}


@pytest.fixture(scope="module")
def embedded_rows(stack, recorded):
    runner = make_runner(recorded["topology"], "features", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        rows = read_rows(stack.kafka, f"{recorded['prefix']}.features.device_window",
                         recorded["out_codec"], idle_s=4.0)
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
                    source=recorded["source"], output=output,
                    bounded=True, online_project=f"{prefix}-flink")
    run_job(argv, timeout_s=300, log_path=Path(recorded["tmp"]) / "flink.log")
    rows = read_rows(stack.kafka, output, recorded["out_codec"], idle_s=1.0)
    return by_window(rows, key="device_id"), count_records(stack.kafka, dlq)


@pytest.fixture(scope="module")
def faust_rows(stack, recorded, embedded_rows):
    prefix = recorded["prefix"]
    output, dlq = f"{prefix}.features.device_window_faust", f"{prefix}.dlq.features_faust"
    create_topics(stack.kafka, [output, dlq])
    argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                             redis_url=stack.redis_url, project=f"{prefix}-faust",
                             source=recorded["source"], output=output, dlq=dlq, group=f"{prefix}.features-faust",
                             feature_set=str(FEATURE_SET_FILE))
    with (Path(recorded["tmp"]) / "faust.log").open("wb") as log:
        worker = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            want = len(embedded_rows[0])
            while count_records(stack.kafka, output) < want and time.monotonic() < deadline:
                assert worker.poll() is None, (Path(recorded["tmp"]) / "faust.log").read_text()[-3000:]
                time.sleep(0.5)
            rows = read_rows(stack.kafka, output, recorded["out_codec"], idle_s=2.0)
        finally:
            worker.terminate()
            worker.wait(30)
    return by_window(rows, key="device_id"), count_records(stack.kafka, dlq)


def test_embedded_engine_matches_a_numpy_reference_with_disorder_and_late_readings(recorded, embedded_rows):
    rows, late = embedded_rows
    expected, expected_late = expected_windows(recorded["readings"], FEATURE_SET)
    assert len(rows) == 20 * 5
    assert diff_rows(expected, rows) == []
    assert late == expected_late >= sum(1 for r in recorded["readings"] if "-l" in r["event_id"]) > 0


def test_flink_job_rows_equal_the_embedded_engine_rows(embedded_rows, flink_rows):
    (embedded, embedded_late), (flink, flink_late) = embedded_rows, flink_rows
    assert len(embedded) == 100
    assert diff_rows(embedded, flink, rel=1e-9) == []
    assert flink_late == embedded_late > 0


def test_faust_job_rows_equal_the_embedded_engine_rows(embedded_rows, faust_rows):
    (embedded, embedded_late), (faust, faust_late) = embedded_rows, faust_rows
    assert diff_rows(embedded, faust, rel=1e-9) == []
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
