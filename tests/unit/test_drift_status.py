"""The status view's pieces without a broker: Prometheus text parsing, histogram quantiles, the rich rendering."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from rich.console import Console

from streams.monitor.scrape import parse, quantile_of_buckets
from streams.monitor.status import render


def test_a_scrape_parses_real_exposition_format_and_answers_quantiles():
    registry = CollectorRegistry()
    counter = Counter("tangram_processor_records_in_total", "in", ["processor"], registry=registry)
    hist = Histogram("tangram_processor_batch_duration_seconds", "t", ["processor"], buckets=(0.01, 0.1, 1),
                     registry=registry)
    counter.labels("ingest").inc(7)
    for v in [0.005] * 90 + [0.05] * 9 + [0.5]:
        hist.labels("ingest").observe(v)
    s = parse(generate_latest(registry).decode())
    assert s.total("tangram_processor_records_in_total", processor="ingest") == 7
    assert s.total("tangram_processor_batch_duration_seconds_count", processor="ingest") == 100
    assert 0.01 < s.histogram_quantile("tangram_processor_batch_duration_seconds", 0.95, processor="ingest") <= 0.1
    assert s.histogram_quantile("tangram_processor_batch_duration_seconds", 0.999, processor="ingest") > 0.1
    assert s.histogram_quantile("tangram_processor_batch_duration_seconds", 0.5, processor="other") is None


def test_quantile_of_buckets_matches_prometheus_rules():
    assert quantile_of_buckets({1.0: 50, 2.0: 100, math.inf: 100}, 0.5) == 1.0
    assert quantile_of_buckets({1.0: 0, 2.0: 100, math.inf: 100}, 0.5) == 1.5
    assert quantile_of_buckets({1.0: 0, math.inf: 10}, 0.9) == 1.0  # in +Inf: the highest finite bound
    assert quantile_of_buckets({}, 0.5) is None


def test_render_shows_every_piece_and_survives_missing_sources():
    snap = {
        "app": "pm", "at_ms": 0,
        "processors": {"ingest": {"replicas": 1, "up": 1, "metrics": ["http://127.0.0.1:9100/metrics"],
                                  "records_in": 10, "records_out": 9, "rate_per_s": 5.0, "p99_ms": 12.5,
                                  "dead_letters": 1, "lag": 0, "dlq_records": 1},
                       "drift": {"replicas": 1, "up": 0, "metrics": [], "records_in": None, "records_out": None,
                                 "rate_per_s": None, "p99_ms": None, "dead_letters": None, "lag": {"error": "x"},
                                 "dlq_records": 0}},
        "config": {"version": 3, "degradation_level": "L1", "monitor_thresholds": {}},
        "models": {"anomaly": {"production": "1", "challenger": "2", "canary_share": 0.05, "versions": ["1", "2"]}},
        "drift": {"features": {"features.temperature_mean": {"drifted": True, "consecutive": 4, "psi": 0.9,
                                                              "pvalue": 1e-9, "test": "ks", "evaluated_ms": 1}},
                  "drifted": ["features.temperature_mean"], "evaluated_ms": 1},
    }
    console = Console(width=160, record=True)
    console.print(render(snap))
    text = console.export_text()
    for expected in ("ingest", "12.5 ms", "127.0.0.1:9100", "version 3, degradation L1", "production 1",
                     "challenger 2 (5%)", "features.temperature_mean (PSI 0.90, 4x)"):
        assert expected in text, expected
    console = Console(width=160, record=True)
    console.print(render({**snap, "config": {"error": "no broker"}, "models": {"error": "no broker"},
                          "drift": {"error": "no broker"}}))
    assert "error: no broker" in console.export_text()
