"""The training baseline drift is measured against: a sample of the training features, stored with the model.

An app's training script writes, beside its model card (``<model>/model_card.json``), a reference
sample of the feature windows it trained on with :func:`write_baseline` (``baseline.npz``, one
column per feature, at most ``MAX_ROWS`` rows) and records the file's sha256 in the card. The
drift job loads it with :func:`load_baseline`, which refuses a sample whose digest or feature
list differs from the card's, so a drift job never compares against the wrong data.

The prediction reference (label shares, confidence sample) is the model itself scoring that
sample with onnxruntime, from the artifact whose sha256 the card records.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streams.errors import DriftBaselineError

log = logging.getLogger("tangram.monitor.baseline")

#: The file beside the model card, and the card field that holds its digest.
BASELINE_FILE = "baseline.npz"
#: Rows kept of the training features: enough for KS and PSI at the drift job's window sizes.
MAX_ROWS = 20_000


@dataclass(frozen=True)
class Baseline:
    """Reference samples: one column per feature, plus the model's labels and confidences on them."""

    model_name: str
    model_version: str
    dataset_version: str
    features: dict[str, np.ndarray]
    label_shares: dict[str, float]
    confidence: np.ndarray


def write_baseline(model_dir: Path, features: Mapping[str, np.ndarray], seed: int = 0) -> dict:
    """Store a sample of the training ``features`` (name → column) as ``<model_dir>/baseline.npz``.

    Returns the card fields to add: ``{"baseline_sample": {"file", "sha256", "rows"}}``. The sample is
    the first ``MAX_ROWS`` rows of a seeded shuffle, so retraining on the same data writes the same file.
    """
    names = list(features)
    matrix = np.column_stack([np.asarray(features[n], dtype=np.float64) for n in names])
    if len(matrix) > MAX_ROWS:
        matrix = matrix[np.random.default_rng(seed).permutation(len(matrix))[:MAX_ROWS]]
    buffer = io.BytesIO()
    np.savez(buffer, names=np.asarray(names), matrix=matrix)
    payload = buffer.getvalue()
    (Path(model_dir) / BASELINE_FILE).write_bytes(payload)
    return {"baseline_sample": {"file": BASELINE_FILE, "sha256": hashlib.sha256(payload).hexdigest(),
                                "rows": int(len(matrix))}}


def score(model_path: Path, x: np.ndarray, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """Labels and confidences of the ONNX model on ``x`` (onnxruntime, CPU)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    p = session.run(None, {session.get_inputs()[0].name: x.astype(np.float32)})[0]
    return [classes[i] for i in p.argmax(axis=1)], p.max(axis=1).astype(np.float64)


def load_baseline(card_path: Path) -> Baseline:
    """Load and check the baseline of the model described by ``card_path``."""
    card_path = Path(card_path)
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError) as exc:
        raise DriftBaselineError(f"cannot read the model card {card_path}: {exc}; build the model first "
                                 "(`tangram models build <app>`) and install it (`tangram apply <app>`)") from exc
    sample = card.get("baseline_sample")
    if not isinstance(sample, dict):
        raise DriftBaselineError(f"model card {card_path} has no `baseline_sample`: its training script must store "
                                 "one (streams.monitor.baseline.write_baseline)")
    path = card_path.parent / str(sample.get("file", BASELINE_FILE))
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise DriftBaselineError(f"baseline sample {path}: {exc}") from exc
    if hashlib.sha256(payload).hexdigest() != sample.get("sha256"):
        raise DriftBaselineError(f"baseline sample {path} does not match the card's sha256: retrain the model")
    with np.load(io.BytesIO(payload), allow_pickle=False) as data:
        names, x = [str(n) for n in data["names"]], data["matrix"]
    if names != list(card.get("features", [])):
        raise DriftBaselineError(f"baseline sample {path} holds other features than the model card lists")
    model_path = card_path.parent / str(card["version"]) / "model.onnx"
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest() if model_path.is_file() else None
    if digest != card.get("sha256"):
        raise DriftBaselineError(f"model artifact {model_path} is missing or does not match the card's sha256")
    labels, confidence = score(model_path, x, list(card["classes"]))
    counts = {c: labels.count(c) for c in card["classes"]}
    log.info("baseline of %s v%s loaded: %d rows of dataset %s", card["name"], card["version"], len(x),
             card.get("dataset_version"))
    return Baseline(
        model_name=str(card["name"]),
        model_version=str(card["version"]),
        dataset_version=str(card.get("dataset_version", "")),
        features={name: x[:, j] for j, name in enumerate(names)},
        label_shares={c: n / len(labels) for c, n in counts.items()},
        confidence=confidence,
    )
