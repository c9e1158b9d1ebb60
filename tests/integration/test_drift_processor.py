"""The drift processor on real Kafka: a stationary stream raises no alert, an injected shift does, in time."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer

from streams.avro import codec
from streams.launcher import LauncherSettings, Processors
from pm_app.train import DatasetParams
from pm_app.drift import COMPARED, declared_delay_rows, feature_rows, stamp
from streams.monitor.scrape import scrape
from streams.plan import apply
from pm_app.simulator import Drift
from streams.topology import load_topology
from reference import load_schema

from isolation import isolated_topology

pytestmark = pytest.mark.integration

ROWS_BEFORE, ROWS_AFTER, FLEET, WINDOW_S = 900, 900, 300, 5.0
METRICS_BASE_PORT = 28700  # below the ephemeral port range (32768-60999)


def _consume_all(stack, topic: str, until, timeout_s: float = 60.0) -> list[dict]:
    """Decode ``topic`` from the beginning until ``until(records)`` holds (or fail at the deadline)."""
    topology_codec = None
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"drift-test-{time.time_ns()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    records: list[dict] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not until(records):
            for msg in consumer.consume(500, 0.5):
                if msg.error():
                    continue
                if topology_codec is None:
                    subject = "pm.monitor.drift-value" if ".monitor." in topic else "pm.actions.alert-value"
                    topology_codec = codec(stack.registry_url, subject, load_schema(subject))
                records.append(topology_codec.decode(msg.value()))
    finally:
        consumer.close()
    return records


def test_a_shift_is_alerted_within_the_declared_delay_and_not_before(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    spec = topology.processors["drift"]
    features_topic = next(t for t in spec.inputs if ".features." in t)
    drift_topic = next(t for t in spec.outputs if ".monitor." in t)
    alert_topic = next(t for t in spec.outputs if ".actions." in t)
    window, step, consecutive = spec.params["window"], spec.params["step"], spec.params["thresholds"]["consecutive"]

    shift = Drift("temperature", "shift", 2.0)
    start_ms = int(time.time() * 1000) - 3_600_000
    rows = stamp(feature_rows(DatasetParams(), 4001)[:ROWS_BEFORE] + feature_rows(DatasetParams(), 4002, [shift])[:ROWS_AFTER],
                 FLEET, WINDOW_S, start_ms)
    features = codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value"))

    def produce(part: list[dict], offset: int) -> None:
        producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "acks": "all"})
        for i, row in enumerate(part, start=offset):
            record = {"device_id": f"dev-{i % FLEET:04d}", "window_start": row["ts_ms"] - 5000,
                      "window_end": row["ts_ms"], "count": 50, **{k: v for k, v in row.items() if k != "ts_ms"}}
            producer.produce(features_topic, features.encode(record), record["device_id"])
        assert producer.flush(30) == 0

    per_eval = len(COMPARED)  # one result per feature compared (the window aggregates, not the rated values)
    due_before = (ROWS_BEFORE - window) // step + 1
    due_all = (ROWS_BEFORE + ROWS_AFTER - window) // step + 1
    with Processors(path, stack, names=["drift"], settings=LauncherSettings(metrics_base_port=METRICS_BASE_PORT)) as procs:
        procs.start()
        procs.wait_joined(timeout_s=90)
        (endpoint,) = procs.endpoints()
        before = scrape(endpoint["metrics_url"])
        # the stationary part first, evaluated completely: then the order of arrival matches the onset
        produce(rows[:ROWS_BEFORE], 0)
        stationary = _consume_all(stack, drift_topic, lambda r: len(r) >= due_before * per_eval)
        produce(rows[ROWS_BEFORE:], ROWS_BEFORE)
        results = _consume_all(stack, drift_topic, lambda r: len(r) >= due_all * per_eval)
        alerts = _consume_all(stack, alert_topic, lambda r: len(r) >= 1, timeout_s=15)
        after = scrape(endpoint["metrics_url"])

    assert len(stationary) == due_before * per_eval and not any(r["sustained"] for r in stationary)
    assert len(results) == due_all * per_eval and {r["feature"] for r in results} == set(COMPARED)  # no rated value
    sustained = [r for r in results if r["sustained"]]
    assert sustained, "the shift was never alerted"
    first = min(sustained, key=lambda r: r["evaluation"])
    assert first["feature"].startswith("temperature")
    # rows consumed when the alerting evaluation ran, minus the stationary rows
    delay_rows = window + (first["evaluation"] - 1) * step - ROWS_BEFORE
    assert 0 < delay_rows <= declared_delay_rows(step, consecutive), delay_rows
    assert first["dataset_version"] == DatasetParams().version and first["model_version"] == "1"

    (alert,) = [a for a in alerts if a["rule"] == f"drift.features.{first['feature']}"][:1]
    assert alert["action_type"] == "alert" and alert["device_id"] == "fleet" and alert["label"] == "drift"
    assert alert["inputs"]["psi"] >= 0.2 and "sustained drift" in alert["reason"]

    # the metrics moved with the traffic, in real Prometheus text format
    assert after.total("tangram_processor_records_in_total", processor="drift") - \
        before.total("tangram_processor_records_in_total", processor="drift") == len(rows)
    assert after.total("tangram_monitor_drift_evaluations_total", monitor="features") == due_all
    assert after.total("tangram_monitor_drift_alerts_total", feature=first["feature"]) >= 1
    assert after.total("tangram_monitor_drift_psi", feature=first["feature"]) >= 0.2
    print(f"\ndrift on Kafka: {due_all} evaluations, first alert on {first['feature']} "
          f"{delay_rows} feature windows after the onset (declared ≤ {declared_delay_rows(step, consecutive)})")
