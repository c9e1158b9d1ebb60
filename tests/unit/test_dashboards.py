"""Dashboards and the Prometheus scrape config: generated from the topology, current, and naming real metrics."""

from __future__ import annotations

import json
import re

import yaml

from reference import REPO as PROJECT_ROOT
from reference import pm_topology
from streams.monitor import dashboards
from streams.monitor.dashboards import DASHBOARDS, dashboard_json, prometheus_yaml

TOPOLOGY = pm_topology()
PROMETHEUS_FILE = PROJECT_ROOT / "deploy" / dashboards.PROMETHEUS_FILE
DASHBOARD_DIR = PROJECT_ROOT / "deploy" / dashboards.DASHBOARD_DIR
COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
#: Metrics that exporters outside this repository define: Prometheus itself (`up`), prometheus_client's
#: default process collector in every processor (`process_*`), and Triton's metrics endpoint (`nv_*`).
EXTERNAL = {"up", "process_cpu_seconds_total", "process_resident_memory_bytes", "nv_gpu_utilization",
            "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes", "nv_inference_request_success",
            "nv_inference_request_failure", "nv_inference_queue_duration_us"}
_DEFINED = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"([a-z_:][a-z0-9_:]*)\"")
_PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "max", "ignoring", "group_left", "le"}


def metrics_defined_in_code() -> set[str]:
    names = set()
    for folder in ("streams", "inference_workers"):
        for path in (PROJECT_ROOT / folder).rglob("*.py"):
            names.update(_DEFINED.findall(path.read_text()))
    return names


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)
    words = set(re.findall(r"[a-z_][a-z0-9_]*", expr)) - _PROMQL_WORDS
    labels = set(re.findall(r"\((?:[a-z_, ]+)\)", expr))
    label_words = {w for group in labels for w in re.findall(r"[a-z_]+", group)}
    return {w for w in words - label_words if "_" in w or w == "up"}


def test_the_scrape_config_is_generated_from_the_topology_and_current():
    assert PROMETHEUS_FILE.read_text() == prometheus_yaml(TOPOLOGY), "run `tangram compose prometheus topologies/predictive_maintenance`"
    for d in DASHBOARDS:
        path = DASHBOARD_DIR / f"{d.uid.removeprefix('tangram-')}.json"
        assert json.loads(path.read_text()) == dashboard_json(d), f"{path} is stale: run `tangram compose prometheus`"


def test_the_scrape_config_lists_every_processor_service_of_the_compose_file():
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    scraped = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                scraped[name] = sd["port"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.partition(":")
                scraped[host] = int(port)
    processor_services = {name: s for name, s in COMPOSE["services"].items()
                          if s.get("command", [None])[0] == "run" and "tools" not in s.get("profiles", [])}
    assert set(processor_services) == set(TOPOLOGY.processors)
    for name, service in processor_services.items():
        command = service["command"]
        port = int(command[command.index("--metrics-port") + 1])
        assert scraped.get(name) == port, f"service {name} serves metrics on {port}; scrape config has {scraped.get(name)}"
    assert scraped["triton"] == 8002


def test_compose_provisions_prometheus_and_grafana_with_these_files():
    services = COMPOSE["services"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    volumes = services["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    provider = yaml.safe_load((PROJECT_ROOT / "deploy/grafana/provisioning/dashboards/tangram.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((PROJECT_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == "prometheus"
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_three_layers_and_every_panel_metric_exists_in_the_code():
    assert [d.uid for d in DASHBOARDS] == ["tangram-model", "tangram-service", "tangram-infrastructure"]
    defined = metrics_defined_in_code()
    assert "tangram_processor_records_in_total" in defined and "tangram_monitor_drift_psi" in defined
    for d in DASHBOARDS:
        for panel in dashboard_json(d)["panels"]:
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                for name in metric_names(target["expr"]):
                    base = re.sub(r"_(bucket|sum|count)$", "", name)
                    assert name in EXTERNAL or base in defined, f"{d.uid} / {panel['title']}: {name} is defined nowhere"


def test_latency_panels_use_percentiles_from_histograms_never_averages():
    for d in DASHBOARDS:
        for panel in dashboard_json(d)["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                if re.search(r"_seconds(?!_total)", expr):  # a latency histogram, not a CPU-seconds counter
                    assert "histogram_quantile" in expr and "_bucket" in expr, (panel["title"], expr)
