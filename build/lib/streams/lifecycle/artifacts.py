"""Artifacts: digests, verification before every load, and registration from a model card.

An artifact whose sha256 differs from the digest the registry holds is never loaded:
:func:`verify_artifact` raises :class:`~streams.errors.ArtifactIntegrityError`, logs an error
and counts ``tangram_models_artifact_rejected_total`` (alert on it). Inference workers and the
model server call it before loading a version (``ModelRegistryWatcher.verified_path``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from streams.errors import ArtifactIntegrityError, ModelRegistryError

log = logging.getLogger("tangram.lifecycle.artifacts")

REJECTED = Counter("tangram_models_artifact_rejected_total",
                   "Model artifacts refused because their sha256 differs from the registry's.", ["model", "version"])


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def resolve_artifact(artifact: str, repository: Path) -> Path:
    """An artifact path as registered: absolute, or relative to the model repository."""
    path = Path(artifact)
    return path if path.is_absolute() else repository / path


def verify_artifact(path: Path, expected_sha256: str, *, model: str = "?", version: str = "?") -> Path:
    """Return ``path`` if its sha256 equals ``expected_sha256``; otherwise refuse to load it."""
    if not path.is_file():
        REJECTED.labels(model, version).inc()
        log.error("artifact of %s %s is missing at %s: not loading it", model, version, path)
        raise ArtifactIntegrityError(f"artifact of {model} {version} is missing at {path}; restore it from the "
                                     "model store before serving this version")
    actual = sha256_file(path)
    if actual != expected_sha256:
        REJECTED.labels(model, version).inc()
        log.error("artifact of %s %s at %s has sha256 %s, registry says %s: not loading it",
                  model, version, path, actual, expected_sha256)
        raise ArtifactIntegrityError(
            f"artifact of {model} {version} at {path} has sha256 {actual}, but the registry holds {expected_sha256}: "
            "the file was changed or replaced after registration; it will not be loaded. Restore the registered "
            "file, or register the new file as a new version.")
    return path


def card_fields(card_path: Path, repository: Path) -> dict[str, Any]:
    """Registration fields read from a ``model_card.json`` written by ``inference_workers/train.py``.

    The artifact is ``<model>/<version>/model.onnx`` next to the card; its digest is computed
    and must equal the card's ``sha256``. A missing ``dataset_version`` is left out, so the
    registration refuses it with the usual message.
    """
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelRegistryError(f"cannot read the model card {card_path}: {exc}") from exc
    name, version = str(card.get("name", "")), str(card.get("version", ""))
    artifact = card_path.parent / version / "model.onnx"
    if not artifact.is_file():
        raise ModelRegistryError(f"model card {card_path} names version {version!r} but {artifact} does not exist")
    actual = sha256_file(artifact)
    if card.get("sha256") and card["sha256"] != actual:
        REJECTED.labels(name, version).inc()
        raise ArtifactIntegrityError(f"{artifact} has sha256 {actual}, but its model card says {card['sha256']}: "
                                     "the artifact was changed after training; retrain or restore it")
    try:
        artifact_ref = str(artifact.resolve().relative_to(repository.resolve()))
    except ValueError:
        artifact_ref = str(artifact.resolve())
    classes, features = list(card.get("classes", [])), list(card.get("features", []))
    fields: dict[str, Any] = {
        "name": name,
        "version": version,
        "sha256": actual,
        "artifact": artifact_ref,
        "framework": card.get("framework", "onnx"),
        "inputs": [{"name": "features", "dtype": "FP32", "shape": [len(features)], "names": features}],
        "outputs": [{"name": "probabilities", "dtype": "FP32", "shape": [len(classes)], "names": classes}],
        "training_metrics": {k: float(v) for k, v in card.get("metrics", {}).items() if isinstance(v, (int, float))},
        "evaluation": {k: v for k, v in card.items() if k in ("metrics", "train_windows", "test_windows")},
    }
    if card.get("dataset_version"):
        fields["dataset_version"] = str(card["dataset_version"])
    return fields
