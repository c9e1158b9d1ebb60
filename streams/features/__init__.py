"""Feature jobs (seed node 2): feature sets declared once, computed by interchangeable engines.

- ``spec``: the declaration (an app's ``features/*.yaml``) as a typed, frozen model;
- ``compute``: the window math and per-partition event-time state every engine shares
  (``compute_window`` is the one definition an app's training script uses too);
- ``engine``: the embedded engine, a processor of the delivery loop (``WindowFeatures``);
- ``faust_job``: the same feature set as a Faust app with windowed tables;
- ``streams.flink.job``: the same feature set as a Flink SQL job (Flink environment);
- ``online``: the online store, Feast's Redis store (writes, and the reads the rules make);
  ``layout``: its key layout, Feast's own, so ``FeatureStore.get_online_features`` reads it too.
  ``streams.feast`` (the Feast repository and its sync bridge, in Feast's environment) builds on
  these; nothing here imports it.

``spec`` and ``compute`` need only numpy, pydantic and PyYAML, so the Flink environment
imports them; the Kafka- and Redis-bound names load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from streams.features.compute import PartitionWindows, band_energy, compute_window, compute_windows
from streams.features.spec import FeatureSet, load_feature_set

_LAZY = {
    "WindowFeatures": "streams.features.engine",
    "WindowFeaturesSettings": "streams.features.engine",
    "online_layout": "streams.features.engine",
    "read_online_features": "streams.features.online",
    "OnlineLookup": "streams.features.online",
    "OnlineWriter": "streams.features.online",
}

__all__ = [
    "PartitionWindows",
    "FeatureSet",
    "OnlineLookup",
    "OnlineWriter",
    "WindowFeatures",
    "WindowFeaturesSettings",
    "band_energy",
    "compute_window",
    "compute_windows",
    "load_feature_set",
    "online_layout",
    "read_online_features",
]


def __getattr__(name: str) -> Any:
    """Load the Kafka- and Redis-bound names on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'streams.features' has no attribute {name!r}")
