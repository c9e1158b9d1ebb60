"""The reference application the benchmarks run, named in this one place.

The topology file and the simulator move with the application (a folder per app); when they do, the
benchmarks follow by changing these lines only.
"""

from __future__ import annotations

from streams import PROJECT_ROOT
from streams.simulator import SENSORS, Device, Fleet

#: The reference topology every end-to-end benchmark namespaces and runs.
TOPOLOGY = PROJECT_ROOT / "topologies" / "predictive_maintenance.yaml"
#: The ONNX file of the model the reference topology serves (what the Quix peer loads in process).
MODEL_ONNX = PROJECT_ROOT / "inference_workers" / "model_repository" / "anomaly" / "1" / "model.onnx"

__all__ = ["TOPOLOGY", "MODEL_ONNX", "SENSORS", "Device", "Fleet"]
