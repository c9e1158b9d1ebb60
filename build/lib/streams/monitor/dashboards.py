"""Grafana dashboards in the seeds' three layers, and the Prometheus scrape config, from the topology.

The seeds' order of diagnosis is model layer first, then service, then infrastructure:

* **model**: prediction confidence (p50/p10), label shares, drift PSI and KS per feature, drifted
  features, drift alerts, rows scored per model version and route;
* **service**: records in/out per processor, dead letters by reason, batch time and Triton call
  p50/p95/p99 (histograms, never averages), queue wait, backpressure, config propagation;
* **infrastructure**: targets up, process CPU and memory of every processor, Triton's GPU
  utilisation and memory, Triton's own request and queue times.

``write_all`` writes ``deploy/prometheus/prometheus.yml`` (one scrape job per processor of the
topology, found by Docker's DNS so ``--scale`` replicas are all scraped, plus Triton) and
``deploy/grafana/dashboards/*.json``; ``tangram compose prometheus`` calls it and the unit tests
check the files are current.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from streams.topology import Topology

#: Where, under a deploy folder (``deploy/`` of a checkout), the scrape config and the dashboards go.
PROMETHEUS_FILE = Path("prometheus") / "prometheus.yml"
DASHBOARD_DIR = Path("grafana") / "dashboards"
PROCESSOR_METRICS_PORT = 9100  # every processor service's `--metrics-port` in docker-compose.yml
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _q(quantile: float, metric: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({quantile}, sum by ({group}) (rate({metric}_bucket[1m])))"


def _percentiles(metric: str, by: str) -> tuple[tuple[str, str], ...]:
    return tuple((_q(q, metric, by), f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.95, 0.99))


MODEL = Dashboard("tangram-model", "Tangram · model layer", "Look here first: is the model still seeing the world it "
                  "was trained on, and is it sure of itself?", (
    Panel("Input quality: null fields and field rejections per field", (
        ("sum by (field) (rate(tangram_ingest_field_missing_total[5m]))", "null {{field}}"),
        ("sum by (field, reason) (rate(tangram_ingest_field_rejected_total[5m]))", "{{reason}} {{field}}")), "rps"),
    Panel("Prediction confidence p50 / p10", (
        (_q(0.5, "tangram_monitor_prediction_confidence", "version"), "p50 v{{version}}"),
        (_q(0.1, "tangram_monitor_prediction_confidence", "version"), "p10 v{{version}}")), "percentunit"),
    Panel("Predicted label shares", ((
        "sum by (label) (rate(tangram_monitor_predictions_total[5m])) / ignoring(label) group_left "
        "sum(rate(tangram_monitor_predictions_total[5m]))", "{{label}}"),), "percentunit"),
    Panel("Drift PSI per feature (0.2: act)", (("tangram_monitor_drift_psi", "{{monitor}}.{{feature}}"),)),
    Panel("Drift KS statistic per feature", (("tangram_monitor_drift_ks_statistic", "{{monitor}}.{{feature}}"),)),
    Panel("Features drifted now", (("sum(tangram_monitor_drift_flagged)", "drifted"),), kind="stat"),
    Panel("Sustained drift alerts", (("sum by (feature) (increase(tangram_monitor_drift_alerts_total[1h]))",
                                      "{{feature}}"),)),
    Panel("Rows scored per model version and route", (
        ("sum by (version, route) (rate(tangram_inference_rows_total[1m]))", "v{{version}} {{route}}"),), "rps"),
    Panel("Config version in effect", (("max by (subscriber) (tangram_config_version)", "{{subscriber}}"),)),
))

SERVICE = Dashboard("tangram-service", "Tangram · service layer", "Rates, errors and latency percentiles of every "
                    "processor of the topology.", (
    Panel("Records in per processor", (("sum by (processor) (rate(tangram_processor_records_in_total[1m]))",
                                        "{{processor}}"),), "rps"),
    Panel("Records out per topic", (("sum by (topic) (rate(tangram_processor_records_out_total[1m]))",
                                     "{{topic}}"),), "rps"),
    Panel("Dead letters by processor and reason", (
        ("sum by (processor, reason) (rate(tangram_processor_dead_letters_total[5m]))", "{{processor}} {{reason}}"),),
        "rps"),
    Panel("Consumer lag per processor", (("sum by (processor) (tangram_processor_consumer_lag_records)",
                                          "{{processor}}"),)),
    Panel("Ingest → committed p50 / p95 / p99 (end-to-end age at each stage)",
          _percentiles("tangram_processor_ingest_to_commit_seconds", "processor"), "s"),
    Panel("Batch time p50 / p95 / p99 (consume → commit)",
          _percentiles("tangram_processor_batch_duration_seconds", "processor"), "s"),
    Panel("Triton call p50 / p95 / p99", _percentiles("tangram_inference_triton_duration_seconds", "version"), "s"),
    Panel("Queue wait before scoring p99", (
        (_q(0.99, "tangram_inference_queue_wait_seconds", "processor"), "p99 {{processor}}"),), "s"),
    Panel("Rows per Triton call p50", ((_q(0.5, "tangram_inference_batch_rows", "version"), "p50 v{{version}}"),)),
    Panel("Inference errors by kind", (("sum by (kind) (rate(tangram_inference_errors_total[5m]))", "{{kind}}"),),
          "rps"),
    Panel("Backpressure: partitions paused", (("max by (processor) (tangram_processor_paused)", "{{processor}}"),)),
    Panel("HTTP ingest p50 / p95 / p99", _percentiles("tangram_gateway_http_request_duration_seconds", "stream"), "s"),
    Panel("Config propagation p99 (written → applied)", (
        (_q(0.99, "tangram_config_propagation_seconds", "subscriber"), "p99 {{subscriber}}"),), "s"),
    Panel("Drift evaluation time p99", (
        (_q(0.99, "tangram_monitor_drift_evaluation_seconds", "monitor"), "p99 {{monitor}}"),), "s"),
))

INFRASTRUCTURE = Dashboard("tangram-infrastructure", "Tangram · infrastructure layer", "Last stop: the processes and "
                           "the GPU under the services.", (
    Panel("Targets up", (("up", "{{job}} {{instance}}"),)),
    Panel("Processor CPU", (("rate(process_cpu_seconds_total[1m])", "{{job}} {{instance}}"),), "percentunit"),
    Panel("Processor resident memory", (("process_resident_memory_bytes", "{{job}} {{instance}}"),), "bytes"),
    Panel("GPU utilisation (Triton)", (("nv_gpu_utilization", "gpu {{gpu_uuid}}"),), "percentunit"),
    Panel("GPU memory used / total (Triton)", (("nv_gpu_memory_used_bytes", "used {{gpu_uuid}}"),
                                               ("nv_gpu_memory_total_bytes", "total {{gpu_uuid}}")), "bytes"),
    Panel("Triton requests per model", (("sum by (model) (rate(nv_inference_request_success[1m]))", "{{model}} ok"),
                                        ("sum by (model) (rate(nv_inference_request_failure[1m]))", "{{model}} failed")),
          "rps"),
    Panel("Triton queue time per request", ((
        "sum by (model) (rate(nv_inference_queue_duration_us[1m])) / sum by (model) "
        "(rate(nv_inference_request_success[1m]))", "{{model}}"),), "µs"),
))

DASHBOARDS: tuple[Dashboard, ...] = (MODEL, SERVICE, INFRASTRUCTURE)


def dashboard_json(d: Dashboard) -> dict:
    """The Grafana JSON model of a dashboard (two panels per row)."""
    panels = []
    for i, p in enumerate(d.panels):
        panels.append({
            "id": i + 1, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
            "gridPos": {"x": 12 * (i % 2), "y": 8 * (i // 2), "w": 12, "h": 8},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(p.exprs)],
        })
    return {"uid": d.uid, "title": d.title, "description": d.description, "tags": ["tangram"], "schemaVersion": 39,
            "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "panels": panels}


def prometheus_config(topology: Topology, *, port: int = PROCESSOR_METRICS_PORT, interval_s: int = 5) -> dict:
    """One scrape job per processor (every replica of its compose service, by DNS), Triton, Prometheus."""
    jobs = [{"job_name": "prometheus", "static_configs": [{"targets": ["localhost:9090"]}]}]
    for name in topology.processors:
        jobs.append({
            "job_name": f"{topology.app}-{name}",
            "dns_sd_configs": [{"names": [name], "type": "A", "port": port, "refresh_interval": "30s"}],
            "relabel_configs": [{"target_label": "service", "replacement": name},
                                {"target_label": "app", "replacement": topology.app}],
        })
    jobs.append({"job_name": "triton", "static_configs": [{"targets": ["triton:8002"]}]})
    return {"global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
            "scrape_configs": jobs}


def prometheus_yaml(topology: Topology) -> str:
    header = ("# Generated from the topology by `tangram compose prometheus` (streams/monitor/dashboards.py);\n"
              "# edit the topology, not this file.\n")
    return header + yaml.safe_dump(prometheus_config(topology), sort_keys=False)


def write_all(topology: Topology, deploy: Path) -> list[Path]:
    """Write the scrape config and the dashboards under ``deploy``; returns the paths written."""
    prom = deploy / PROMETHEUS_FILE
    prom.parent.mkdir(parents=True, exist_ok=True)
    prom.write_text(prometheus_yaml(topology))
    written = [prom]
    folder = deploy / DASHBOARD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for d in DASHBOARDS:
        path = folder / f"{d.uid.removeprefix('tangram-')}.json"
        path.write_text(json.dumps(dashboard_json(d), indent=2, ensure_ascii=False) + "\n")
        written.append(path)
    return written
