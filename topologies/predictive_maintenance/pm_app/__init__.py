"""The predictive-maintenance app's plugin code: its simulator, its training script, its drift measurements.

The runtime imports this package from the app folder (``topologies/predictive_maintenance``) when the
topology names it (``simulator.kind``, ``models.build``); it imports the runtime, never the other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from streams.features import compute_window, load_feature_set

#: The app folder: this package's parent.
APP_DIR = Path(__file__).resolve().parent.parent
#: The app's feature set, declared once (``features/device_window.yaml``): the training script and the
#: drift measurements compute exactly what the features processor computes.
FEATURE_SET = load_feature_set(APP_DIR / "features" / "device_window.yaml")
#: The model's input vector, in order: the window aggregates, then the register's attributes.
FEATURE_NAMES: tuple[str, ...] = FEATURE_SET.feature_names
assert FEATURE_SET.enrichment is not None, "the app's feature set joins the fleet register"
ENRICHMENT = FEATURE_SET.enrichment


def window_features(values: np.ndarray, hz: float) -> dict[str, float]:
    """Aggregates of one window of readings (samples × sensors, NaN = missing), as every engine computes them."""
    return compute_window(FEATURE_SET, values, hz)


def attribute_vector(register: Mapping[str, object] | None) -> list[float]:
    """A device's register entry (a ``pm.devices`` value) as the vector's attributes, encoded by the engines' own
    encoder; ``None``: a device the register does not know, joined with the declared defaults."""
    return ENRICHMENT.encode(register)


def feature_vector(features: Mapping[str, float], register: Mapping[str, object] | None = None) -> list[float]:
    """The model's input vector: a window's aggregates (``window_features``), then its device's attributes."""
    return [float(features[name]) for name in FEATURE_SET.aggregate_names] + attribute_vector(register)
