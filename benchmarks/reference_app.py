"""The reference application the benchmarks run, named in this one place (the runtime knows no app).

The app is a folder; its plugin code (``pm_app``: the simulator, the training script, the drift
measurements) is imported from it, as the runtime imports it from a topology.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The predictive-maintenance app folder and its topology, which every end-to-end benchmark namespaces and runs.
APP = REPO / "topologies" / "predictive_maintenance"
TOPOLOGY = APP / "topology.yaml"
#: The ONNX file of the model the reference topology serves (what the Quix peer loads in process).
MODEL_ONNX = APP / "model_repository" / "anomaly" / "1" / "model.onnx"
#: The feature set its features processor computes (what the Faust and PyFlink engines are given too).
FEATURE_SET_FILE = APP / "features" / "device_window.yaml"
#: The reference apps' contracts.
SCHEMAS = REPO / "schemas" / "avro"

if str(APP) not in sys.path:
    sys.path.append(str(APP))

from pm_app import FEATURE_NAMES, FEATURE_SET  # noqa: E402
from pm_app.simulator import SENSORS, Device, Fleet, FleetSettings, FleetSimulator, recorded_readings  # noqa: E402


def load_schema(subject: str) -> dict:
    """A reference contract by subject."""
    return json.loads((SCHEMAS / f"{subject}.avsc").read_text())


__all__ = ["APP", "FEATURE_NAMES", "FEATURE_SET", "FEATURE_SET_FILE", "MODEL_ONNX", "REPO", "SCHEMAS", "SENSORS", "TOPOLOGY", "Device",
           "Fleet", "FleetSettings", "FleetSimulator", "load_schema", "recorded_readings"]
