"""Observability (seed node 6): drift jobs, metrics endpoints, the live status view, dashboards.

- ``stats``: KS, PSI and chi-square over sliding windows, and the sustained-drift detector;
- ``baseline``: the training baseline, a sample of the training features stored beside the model card;
- ``processor``: ``DriftMonitor``, the drift job as a processor of the delivery loop;
- ``scrape``: reading a processor's ``/metrics`` (Prometheus text format);
- ``status``: ``tangram status --topology``, the live view of a running topology;
- ``dashboards``: the Grafana dashboards (three layers) and the Prometheus scrape config, from a topology.

The Kafka-bound names load on first use, so the statistics import with numpy and scipy only.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "DriftMonitor": "streams.monitor.processor",
    "DriftSettings": "streams.monitor.processor",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    """Load the Kafka-bound names on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'streams.monitor' has no attribute {name!r}")
