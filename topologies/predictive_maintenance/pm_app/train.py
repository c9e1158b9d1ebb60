"""Train the app's anomaly model on simulated telemetry and export it to ONNX (``tangram models build``).

Multinomial logistic regression over the window features of the app's feature set, with the
standardisation folded into the ONNX graph, so the served model takes raw feature vectors.
Deterministic for a given seed. Writes, under a model repository:

- ``anomaly/1/model.onnx``   the model Triton serves (input ``features`` [N, 27] FP32,
  output ``probabilities`` [N, 3] FP32 over ``CLASSES``, the order of ``labels.txt``);
- ``anomaly/model_card.json`` dataset version, metrics, classes, feature names, per-feature
  summary statistics, and the digest of ``anomaly/baseline.npz``, the sample of training
  features the drift job compares live windows with (``streams.monitor.baseline``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from scipy.optimize import minimize

from pydantic import BaseModel, ConfigDict, Field

from pm_app import FEATURE_NAMES, feature_vector, window_features
from pm_app.simulator import windows_for_training
from streams.monitor.baseline import write_baseline

log = logging.getLogger("tangram.pm.train")

CLASSES: tuple[str, ...] = ("healthy", "bearing_wear", "overheating")
MODEL_NAME = "anomaly"


class DatasetParams(BaseModel):
    """The parameters of a simulated training set (``train``'s defaults); they name the dataset version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = Field(42, description="Random seed of the simulated training fleet.")
    n_devices: int = Field(300, ge=1)
    seconds: float = Field(180.0, gt=0)
    window_s: float = Field(5.0, gt=0)
    hz: float = Field(10.0, gt=0)

    @property
    def version(self) -> str:
        """The ``dataset_version`` ``train`` writes for these parameters."""
        payload = json.dumps([self.seed, self.n_devices, self.seconds, self.window_s, self.hz]).encode()
        return "sim-v1-" + hashlib.sha256(payload).hexdigest()[:12]


def build_dataset(n_devices: int, seconds: float, window_s: float, hz: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    windows, labels, _ = windows_for_training(n_devices, seconds, window_s, hz, seed)
    x = np.array([feature_vector(window_features(w, hz)) for w in windows], dtype=np.float64)
    y = np.array([CLASSES.index(label) for label in labels])
    return x, y


def fit_softmax(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression by L-BFGS on the mean cross-entropy plus an L2 penalty."""
    n, d = x.shape
    k = len(CLASSES)
    onehot = np.eye(k)[y]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[: d * k].reshape(d, k), theta[d * k:]
        logits = x @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        value = -np.mean(np.log(p[np.arange(n), y] + 1e-12)) + l2 * np.sum(w * w)
        g = (p - onehot) / n
        grad = np.concatenate([(x.T @ g + 2 * l2 * w).ravel(), g.sum(axis=0)])
        return value, grad

    result = minimize(loss, np.zeros(d * k + k), jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return result.x[: d * k].reshape(d, k), result.x[d * k:]


def to_onnx(mean: np.ndarray, std: np.ndarray, w: np.ndarray, b: np.ndarray) -> onnx.ModelProto:
    """features → (x - mean) / std → x @ W + b → softmax → probabilities."""
    f32 = np.float32
    inits = [
        numpy_helper.from_array(mean.astype(f32), "mean"),
        numpy_helper.from_array(std.astype(f32), "std"),
        numpy_helper.from_array(w.astype(f32), "W"),
        numpy_helper.from_array(b.astype(f32), "b"),
    ]
    nodes = [
        helper.make_node("Sub", ["features", "mean"], ["centered"]),
        helper.make_node("Div", ["centered", "std"], ["scaled"]),
        helper.make_node("MatMul", ["scaled", "W"], ["logits_raw"]),
        helper.make_node("Add", ["logits_raw", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        MODEL_NAME,
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", len(FEATURE_NAMES)])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", len(CLASSES)])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tangram.train")
    model.ir_version = 8  # readable by older ONNX Runtime builds (Triton's backend, PyTriton's pin)
    onnx.checker.check_model(model)
    return model


def evaluate(p: np.ndarray, y: np.ndarray) -> dict:
    pred = p.argmax(axis=1)
    report = {"accuracy": float((pred == y).mean()), "per_class": {}}
    for k, name in enumerate(CLASSES):
        tp = int(((pred == k) & (y == k)).sum())
        precision = tp / max(1, int((pred == k).sum()))
        recall = tp / max(1, int((y == k).sum()))
        report["per_class"][name] = {"precision": round(precision, 4), "recall": round(recall, 4), "support": int((y == k).sum())}
    return report


def train(repository: Path, *, seed: int = 42, n_devices: int = 300, seconds: float = 180.0,
          window_s: float = 5.0, hz: float = 10.0, version: int = 1, blind_to: tuple[str, ...] = ()) -> dict:
    """Train, evaluate on held-out devices, export. Returns the model card.

    ``blind_to`` labels those classes ``healthy`` in the training data: a deliberately weaker model,
    for backtests and canary drills that must show a difference built in on purpose.
    """
    started = time.perf_counter()
    x_train, y_train = build_dataset(n_devices, seconds, window_s, hz, seed)
    for name in blind_to:
        y_train[y_train == CLASSES.index(name)] = CLASSES.index("healthy")
    x_test, y_test = build_dataset(max(50, n_devices // 4), seconds, window_s, hz, seed + 1)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std < 1e-9] = 1.0
    w, b = fit_softmax((x_train - mean) / std, y_train)
    model = to_onnx(mean, std, w, b)

    import onnxruntime as ort  # check the exported graph with the runtime Triton uses

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    p_test = session.run(None, {"features": x_test.astype(np.float32)})[0]
    dataset_version = "sim-v1-" + hashlib.sha256(
        json.dumps([seed, n_devices, seconds, window_s, hz, *([sorted(blind_to)] if blind_to else [])]).encode()
    ).hexdigest()[:12]

    target = repository / MODEL_NAME / str(version) / "model.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = model.SerializeToString()
    target.write_bytes(payload)
    card = {
        "name": MODEL_NAME,
        "version": str(version),
        "framework": "onnx",
        "sha256": hashlib.sha256(payload).hexdigest(),
        "dataset_version": dataset_version,
        "classes": list(CLASSES),
        "features": list(FEATURE_NAMES),
        "train_windows": int(len(y_train)),
        "test_windows": int(len(y_test)),
        "metrics": evaluate(p_test, y_test),
        "baseline": {
            name: {"mean": float(x_train[:, j].mean()), "std": float(x_train[:, j].std()),
                   "quantiles": np.quantile(x_train[:, j], np.linspace(0, 1, 11)).tolist()}
            for j, name in enumerate(FEATURE_NAMES)
        },
        **write_baseline(repository / MODEL_NAME, {name: x_train[:, j] for j, name in enumerate(FEATURE_NAMES)}, seed),
        "trained_s": round(time.perf_counter() - started, 2),
    }
    (repository / MODEL_NAME / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    log.info("trained %s v%s on %d windows in %.1fs: test accuracy %.4f -> %s", MODEL_NAME, version,
             len(y_train), card["trained_s"], card["metrics"]["accuracy"], target)
    return card


def build(repository: Path, force: bool = False) -> str:
    """The app's ``models.build`` hook: train version 1 into ``repository`` unless it is there already."""
    model_dir = repository / MODEL_NAME
    if not force and (model_dir / "1" / "model.onnx").is_file() and (model_dir / "model_card.json").is_file():
        return f"{MODEL_NAME} v1 already built in {repository} (--force rebuilds it)"
    card = train(repository)
    m = card["metrics"]
    return (f"{MODEL_NAME} v{card['version']} dataset {card['dataset_version']}: held-out accuracy {m['accuracy']:.4f}; "
            + ", ".join(f"{k} P={v['precision']:.3f} R={v['recall']:.3f}" for k, v in m["per_class"].items()))
