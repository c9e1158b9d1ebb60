"""The predictive-maintenance app's plugin code: its simulator, its training script, its drift measurements.

The runtime imports this package from the app folder (``topologies/predictive_maintenance``) when the
topology names it (``simulator.kind``, ``models.build``); it imports the runtime, never the other way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streams.features import compute_window, load_feature_set

#: The app folder: this package's parent.
APP_DIR = Path(__file__).resolve().parent.parent
#: The app's feature set, declared once (``features/device_window.yaml``): the training script and the
#: drift measurements compute exactly what the features processor computes.
FEATURE_SET = load_feature_set(APP_DIR / "features" / "device_window.yaml")
#: The model's input vector, in order.
FEATURE_NAMES: tuple[str, ...] = FEATURE_SET.feature_names


def window_features(values: np.ndarray, hz: float) -> dict[str, float]:
    """Features of one window of readings (samples × sensors, NaN = missing), as every engine computes them."""
    return compute_window(FEATURE_SET, values, hz)


def feature_vector(features: dict[str, float]) -> list[float]:
    """The model's input vector from a feature dict."""
    return FEATURE_SET.vector(features)
