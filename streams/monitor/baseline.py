"""The training baseline drift is measured against, rebuilt exactly from the model card.

``model_card.json`` (written by ``inference_workers/train.py``) keeps, per feature, the mean,
the standard deviation and eleven quantiles of the training windows — too little for a KS test,
which needs the reference *sample*. The training data is itself simulated and deterministic, so
the sample is regenerated instead of stored: ``windows_for_training`` and ``window_features`` with
the dataset parameters whose hash is the card's ``dataset_version`` (``sim-v1-<sha256[:12]>`` of
``[seed, n_devices, seconds, window_s, hz]``). The rebuild is checked twice — the parameters must
hash to the card's version and every feature's mean must equal the card's — so a drift job never
compares against the wrong data. About 2 s for the reference model's 10,610 windows.

The prediction reference (label shares, confidence sample) is the model itself scoring that
sample with onnxruntime, from the artifact whose sha256 the card records.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from streams.errors import DriftBaselineError
from streams.features import FEATURE_NAMES, feature_vector, window_features
from streams.simulator import windows_for_training

log = logging.getLogger("tangram.monitor.baseline")


class DatasetParams(BaseModel):
    """The parameters of a simulated training set (``inference_workers.train.train``'s defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = Field(42, description="Random seed of the simulated training fleet.")
    n_devices: int = Field(300, ge=1)
    seconds: float = Field(180.0, gt=0)
    window_s: float = Field(5.0, gt=0)
    hz: float = Field(10.0, gt=0)

    @property
    def version(self) -> str:
        """The ``dataset_version`` ``train.py`` writes for these parameters."""
        payload = json.dumps([self.seed, self.n_devices, self.seconds, self.window_s, self.hz]).encode()
        return "sim-v1-" + hashlib.sha256(payload).hexdigest()[:12]


@dataclass(frozen=True)
class Baseline:
    """Reference samples: one column per feature, plus the model's labels and confidences on them."""

    model_name: str
    model_version: str
    dataset_version: str
    features: dict[str, np.ndarray]
    label_shares: dict[str, float]
    confidence: np.ndarray


def reference_matrix(params: DatasetParams) -> np.ndarray:
    """The training feature matrix, (windows, len(FEATURE_NAMES)), regenerated."""
    windows, _, _ = windows_for_training(params.n_devices, params.seconds, params.window_s, params.hz, params.seed)
    return np.array([feature_vector(window_features(w, params.hz)) for w in windows], dtype=np.float64)


def score(model_path: Path, x: np.ndarray, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """Labels and confidences of the ONNX model on ``x`` (onnxruntime, CPU)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    p = session.run(None, {session.get_inputs()[0].name: x.astype(np.float32)})[0]
    return [classes[i] for i in p.argmax(axis=1)], p.max(axis=1).astype(np.float64)


def load_baseline(card_path: Path, params: DatasetParams = DatasetParams()) -> Baseline:
    """Rebuild and check the baseline of the model described by ``card_path``."""
    try:
        card = json.loads(Path(card_path).read_text())
    except (OSError, ValueError) as exc:
        raise DriftBaselineError(f"cannot read the model card {card_path}: {exc}; train the model first "
                                 "(`tangram model train`)") from exc
    if card.get("dataset_version") != params.version:
        raise DriftBaselineError(
            f"model card {card_path} says dataset {card.get('dataset_version')!r}, but the drift job's dataset "
            f"parameters {params.model_dump()} are {params.version!r}: set the drift processor's `dataset` params "
            "to those the model was trained with")
    if list(card.get("features", [])) != list(FEATURE_NAMES):
        raise DriftBaselineError(f"model card {card_path} lists other features than the feature set: retrain the model")
    x = reference_matrix(params)
    for j, name in enumerate(FEATURE_NAMES):
        want = card["baseline"][name]["mean"]
        if not np.isclose(x[:, j].mean(), want, rtol=1e-9, atol=1e-12):
            raise DriftBaselineError(f"rebuilt training data differs from the card on {name} (mean {x[:, j].mean()} "
                                     f"vs {want}): the simulator changed since training; retrain the model")
    model_path = Path(card_path).parent / str(card["version"]) / "model.onnx"
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest() if model_path.is_file() else None
    if digest != card.get("sha256"):
        raise DriftBaselineError(f"model artifact {model_path} is missing or does not match the card's sha256")
    labels, confidence = score(model_path, x, list(card["classes"]))
    counts = {c: labels.count(c) for c in card["classes"]}
    log.info("baseline of %s v%s rebuilt: %d windows of dataset %s", card["name"], card["version"], len(x),
             params.version)
    return Baseline(
        model_name=str(card["name"]),
        model_version=str(card["version"]),
        dataset_version=params.version,
        features={name: x[:, j] for j, name in enumerate(FEATURE_NAMES)},
        label_shares={c: n / len(labels) for c, n in counts.items()},
        confidence=confidence,
    )
