"""Train the app's anomaly model on simulated telemetry and export it to ONNX (``tangram models build``).

Multinomial logistic regression over the window features of the app's feature set, with the
standardisation folded into the ONNX graph, so the served model takes raw feature vectors.
A training vector is what the features stage emits for the window: its aggregates, then its
device's register attributes (``enrichment.attributes``: the rated values) encoded by the runtime's
own encoder (``EnrichmentSpec.encode``). The windows of a share of the training devices
(``defaults_share``, 20 % by default) are joined with the declared defaults instead, as a device the
register does not know is joined live (a verify probe, a load generator, a benchmark's fleet), so the
model has seen such vectors. Deterministic for a given seed. Writes, under a model repository:

- ``anomaly/1/model.onnx``   the model Triton serves (input ``features`` [N, len(FEATURE_NAMES)] FP32,
  output ``probabilities`` [N, 3] FP32 over ``CLASSES``, the order of ``labels.txt``);
- ``anomaly/model_card.json`` dataset version, metrics, classes, feature names, per-feature
  summary statistics, and the digest of ``anomaly/baseline.npz``, the sample of training
  features the drift job compares live windows with (``streams.monitor.baseline``). Its held-out
  figures: ``metrics`` (the served model, held-out devices joined with their register),
  ``metrics_without_attributes`` (the same training on the aggregates alone: what the attributes add)
  and ``metrics_with_defaults`` (the served model on the same held-out windows joined with the
  defaults: an unregistered device).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from scipy.optimize import minimize

from pydantic import BaseModel, ConfigDict, Field

from pm_app import FEATURE_NAMES, FEATURE_SET, attribute_vector, feature_vector, window_features
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
    defaults_share: float = Field(0.2, ge=0, le=1, description="Share of the training devices joined with the "
                                                                "feature set's attribute defaults (unregistered).")

    @property
    def version(self) -> str:
        """The ``dataset_version`` ``train`` writes for these parameters."""
        return dataset_version(self.seed, self.n_devices, self.seconds, self.window_s, self.hz, self.defaults_share)


def dataset_version(seed: int, n_devices: int, seconds: float, window_s: float, hz: float, defaults_share: float,
                    blind_to: tuple[str, ...] = ()) -> str:
    """``sim-v2-…``: v2 vectors carry the register's attributes after the aggregates."""
    payload = json.dumps([seed, n_devices, seconds, window_s, hz, defaults_share,
                          *([sorted(blind_to)] if blind_to else [])]).encode()
    return "sim-v2-" + hashlib.sha256(payload).hexdigest()[:12]


class Dataset(NamedTuple):
    """Simulated windows as model inputs: the aggregates, the attributes of each window's device, the labels."""

    aggregates: np.ndarray  # (windows, len(FEATURE_SET.aggregate_names))
    attributes: np.ndarray  # (windows, len(FEATURE_SET.attribute_names)): the register's, or the defaults
    labels: np.ndarray  # index into CLASSES

    @property
    def x(self) -> np.ndarray:
        """The model's input vectors, in ``FEATURE_NAMES`` order."""
        return np.hstack([self.aggregates, self.attributes])

    def with_defaults(self) -> Dataset:
        """The same windows joined with the attribute defaults, as if no device were registered."""
        return self._replace(attributes=np.tile(attribute_vector(None), (len(self.labels), 1)))


def build_dataset(n_devices: int, seconds: float, window_s: float, hz: float, seed: int,
                  defaults_share: float = 0.0) -> Dataset:
    """Windows of a simulated fleet; the devices of a seeded share ``defaults_share`` join the attribute defaults
    (unregistered), the others their own register entry."""
    windows, labels, _, registers = windows_for_training(n_devices, seconds, window_s, hz, seed)
    devices = sorted({r["device_id"] for r in registers})
    unregistered = set(np.random.default_rng(seed).permutation(devices)[:round(defaults_share * len(devices))])
    x = np.array([feature_vector(window_features(w, hz), None if r["device_id"] in unregistered else r)
                  for w, r in zip(windows, registers)], dtype=np.float64)
    split = len(FEATURE_SET.aggregate_names)
    return Dataset(x[:, :split], x[:, split:], np.array([CLASSES.index(label) for label in labels]))


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


class Fitted(NamedTuple):
    """A trained model in numpy: standardisation, then softmax regression."""

    mean: np.ndarray
    std: np.ndarray
    w: np.ndarray
    b: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray) -> Fitted:
        mean, std = x.mean(axis=0), x.std(axis=0)
        std[std < 1e-9] = 1.0
        return cls(mean, std, *fit_softmax((x - mean) / std, y))

    def predict(self, x: np.ndarray) -> np.ndarray:
        logits = (x - self.mean) / self.std @ self.w + self.b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)


def train(repository: Path, *, seed: int = 42, n_devices: int = 300, seconds: float = 180.0,
          window_s: float = 5.0, hz: float = 10.0, defaults_share: float = 0.2, version: int = 1,
          blind_to: tuple[str, ...] = ()) -> dict:
    """Train, evaluate on held-out devices, export. Returns the model card.

    The training devices of a share ``defaults_share`` are joined with the attribute defaults (an unregistered
    device), the others with their register entry. ``blind_to`` labels those classes ``healthy`` in the
    training data: a deliberately weaker model, for backtests and canary drills that must show a difference
    built in on purpose.
    """
    started = time.perf_counter()
    train_set = build_dataset(n_devices, seconds, window_s, hz, seed, defaults_share)
    y_train = train_set.labels
    for name in blind_to:
        y_train[y_train == CLASSES.index(name)] = CLASSES.index("healthy")
    test_set = build_dataset(max(50, n_devices // 4), seconds, window_s, hz, seed + 1)
    x_train, y_test = train_set.x, test_set.labels
    fitted = Fitted.fit(x_train, y_train)
    model = to_onnx(*fitted)
    # what the attributes add: the same training on the aggregates alone, on the same held-out windows
    aggregates_only = Fitted.fit(train_set.aggregates, y_train)

    import onnxruntime as ort  # check the exported graph with the runtime Triton uses

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def served(data: Dataset) -> np.ndarray:
        return session.run(None, {"features": data.x.astype(np.float32)})[0]

    target = repository / MODEL_NAME / str(version) / "model.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = model.SerializeToString()
    target.write_bytes(payload)
    card = {
        "name": MODEL_NAME,
        "version": str(version),
        "framework": "onnx",
        "sha256": hashlib.sha256(payload).hexdigest(),
        "dataset_version": dataset_version(seed, n_devices, seconds, window_s, hz, defaults_share, blind_to),
        "classes": list(CLASSES),
        "features": list(FEATURE_NAMES),
        "attributes": list(FEATURE_SET.attribute_names),
        "attribute_defaults_share": defaults_share,
        "train_windows": int(len(y_train)),
        "test_windows": int(len(y_test)),
        "metrics": evaluate(served(test_set), y_test),
        "metrics_without_attributes": evaluate(aggregates_only.predict(test_set.aggregates), y_test),
        "metrics_with_defaults": evaluate(served(test_set.with_defaults()), y_test),
        "baseline": {
            name: {"mean": float(x_train[:, j].mean()), "std": float(x_train[:, j].std()),
                   "quantiles": np.quantile(x_train[:, j], np.linspace(0, 1, 11)).tolist()}
            for j, name in enumerate(FEATURE_NAMES)
        },
        **write_baseline(repository / MODEL_NAME, {name: x_train[:, j] for j, name in enumerate(FEATURE_NAMES)}, seed),
        "trained_s": round(time.perf_counter() - started, 2),
    }
    (repository / MODEL_NAME / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    log.info("trained %s v%s on %d windows in %.1fs: test accuracy %.4f (%.4f without attributes, %.4f with the "
             "defaults) -> %s", MODEL_NAME, version, len(y_train), card["trained_s"], card["metrics"]["accuracy"],
             card["metrics_without_attributes"]["accuracy"], card["metrics_with_defaults"]["accuracy"], target)
    return card


def build(repository: Path, force: bool = False) -> str:
    """The app's ``models.build`` hook: train version 1 into ``repository`` unless it is there already, trained
    on today's dataset and feature vector (a model built before the feature set changed is trained again)."""
    model_dir = repository / MODEL_NAME
    if not force and (model_dir / "1" / "model.onnx").is_file() and (card_path := model_dir / "model_card.json").is_file():
        built = json.loads(card_path.read_text())
        if built.get("dataset_version") == DatasetParams().version and built.get("features") == list(FEATURE_NAMES):
            return f"{MODEL_NAME} v1 already built in {repository} (--force rebuilds it)"
        log.info("%s v1 in %s was trained on dataset %s with %d inputs: training it again on %s with %d",
                 MODEL_NAME, repository, built.get("dataset_version"), len(built.get("features", ())),
                 DatasetParams().version, len(FEATURE_NAMES))
    card = train(repository)
    m = card["metrics"]
    return (f"{MODEL_NAME} v{card['version']} dataset {card['dataset_version']}: held-out accuracy {m['accuracy']:.4f}; "
            + ", ".join(f"{k} P={v['precision']:.3f} R={v['recall']:.3f}" for k, v in m["per_class"].items())
            + f"; without the attributes {card['metrics_without_attributes']['accuracy']:.4f}, "
              f"with the defaults {card['metrics_with_defaults']['accuracy']:.4f} ({card['test_windows']} windows)")
