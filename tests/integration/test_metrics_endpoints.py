"""Every processor of the running topology serves /metrics (real Prometheus text format) and its counters move
with the traffic; ``tangram status --topology --once --json`` reports the same running pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from reference import REPO as PROJECT_ROOT
from streams.simulation import build_simulator, flush, producer, run_ticks
from streams.launcher import LauncherSettings, Processors, read_endpoints
from streams.monitor.scrape import Scrape, scrape
from streams.plan import apply
from streams.topology import load_topology

from isolation import isolated_topology

pytestmark = pytest.mark.integration

METRICS_BASE_PORT = 28710  # below the ephemeral port range (32768-60999)
SECONDS, DEVICES = 30.0, 20


def _scrape_all(procs: Processors) -> dict[str, Scrape]:
    return {e["name"]: scrape(e["metrics_url"]) for e in procs.endpoints()}


@pytest.fixture(scope="module")
def running(stack, tmp_path_factory):
    """The whole reference topology (isolated, drift window shortened) with traffic flowing through it."""
    path, _ = isolated_topology(tmp_path_factory.mktemp("metrics"))
    path.write_text(path.read_text().replace("      window: 300\n", "      window: 40\n")
                    .replace("      step: 100\n", "      step: 20\n"))
    topology = load_topology(path)
    apply(topology, stack)
    procs = Processors(path, stack, settings=LauncherSettings(metrics_base_port=METRICS_BASE_PORT))
    try:
        procs.start()
        procs.wait_joined(timeout_s=120)
        before = _scrape_all(procs)
        out = producer(stack)
        simulator = build_simulator(topology, entities=DEVICES, seed=3)
        sent = sum(len(events) for events in run_ticks(simulator, out, SECONDS, int(time.time() * 1000) - 120_000,
                                                        realtime=False))
        flush(out, 30)
        deadline = time.monotonic() + 120
        writers = [name for name, spec in topology.processors.items() if spec.outputs]
        while time.monotonic() < deadline:  # drift evaluated both streams, and every writer's outputs are out
            now = _scrape_all(procs)
            if all(now["drift"].total("tangram_monitor_drift_evaluations_total", monitor=m) >= 1
                   for m in ("features", "predictions")) and \
                    all(now[n].total("tangram_processor_records_out_total", processor=n) >
                        before[n].total("tangram_processor_records_out_total", processor=n) for n in writers):
                break
            time.sleep(1)
        yield {"procs": procs, "path": path, "topology": topology, "before": before, "after": _scrape_all(procs),
               "sent": sent}
    finally:
        procs.stop()


def test_every_processor_serves_metrics_and_its_counters_move(running):
    procs, topology, before, after = running["procs"], running["topology"], running["before"], running["after"]
    endpoints = procs.endpoints()
    assert sorted(e["name"] for e in endpoints) == sorted(topology.processors)
    assert len({e["metrics_url"] for e in endpoints}) == len(endpoints), "two processors share a metrics port"
    assert read_endpoints(procs.stack, topology.app) == endpoints  # what `tangram status --topology` reads
    for name in topology.processors:
        moved_in = after[name].total("tangram_processor_records_in_total", processor=name) - \
            before[name].total("tangram_processor_records_in_total", processor=name)
        moved_out = after[name].total("tangram_processor_records_out_total", processor=name) - \
            before[name].total("tangram_processor_records_out_total", processor=name)
        batches = after[name].total("tangram_processor_batch_duration_seconds_count", processor=name)
        writes = bool(topology.processors[name].outputs)  # the canary job writes only to the model registry
        assert moved_in > 0 and (moved_out > 0 or not writes) and batches > 0, (name, moved_in, moved_out, batches)
        assert after[name].histogram_quantile("tangram_processor_batch_duration_seconds", 0.99, processor=name) > 0
        assert "process_resident_memory_bytes" in after[name].families  # infrastructure layer
    ingest = after["ingest"]
    assert ingest.total("tangram_processor_records_in_total", processor="ingest") == running["sent"]
    assert ingest.total("tangram_processor_dead_letters_total", processor="ingest") > 0  # clock skew, malformed
    assert after["inference"].total("tangram_inference_rows_total") > 0
    assert after["drift"].total("tangram_monitor_predictions_total") > 0
    assert after["drift"].total("tangram_monitor_prediction_confidence_count") > 0


def test_status_once_json_reports_the_running_topology(running):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", "streams", "status", "--topology", str(running["path"]), "--once",
                          "--json", "--interval", "1"], capture_output=True, text=True, env=env, cwd=PROJECT_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    snap = json.loads(out.stdout)
    topology = running["topology"]
    assert snap["app"] == topology.app and set(snap["processors"]) == set(topology.processors)
    for name, p in snap["processors"].items():
        assert p["up"] == p["replicas"] == 1, (name, p)
        assert p["records_in"] > 0 and p["rate_per_s"] is not None and p["p99_ms"] > 0, (name, p)
        assert isinstance(p["lag"], int) and p["lag"] >= 0, (name, p)
        assert isinstance(p["dlq_records"], int), (name, p)
    assert snap["processors"]["ingest"]["dlq_records"] > 0
    assert isinstance(snap["config"]["version"], int) and snap["config"]["degradation_level"] in ("L0", "L1", "L2", "L3")
    assert isinstance(snap["models"], dict) and "error" not in snap["models"]
    drift = snap["drift"]
    assert "features.temperature_mean" in drift["features"] and "predictions.label" in drift["features"]
    assert set(drift["drifted"]) <= set(drift["features"])
