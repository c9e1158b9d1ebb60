"""The inference worker without a broker or Triton: routing, refused rows, backpressure.

Triton is replaced by an in-process model with the same async interface as TritonModel, so the
worker's decisions (which version scores which row, when to back off, when a row goes to the
DLQ) are tested on their own; tests/integration/test_worker.py runs them on the real services.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from inference_workers.routing import ModelTarget
from inference_workers.triton_client import ModelContract
from inference_workers.worker import InferenceSettings, InferenceWorker
from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.delivery import Record
from streams.errors import BackpressureError, InferenceError, InferenceUnavailableError
from pm_app import FEATURE_NAMES
from reference import PM, load_schema

POISON = -999.0  # a feature value the fake model refuses, as Triton refuses a row it cannot score


class FakeRegistry:
    def lookup(self, subject: str, text: str) -> int:
        return {"pm.features.device_window-value": 1, "pm.predictions.anomaly-value": 2}[subject]

    def parsed(self, schema_id: int):
        raise WireFormatError(f"unknown schema id {schema_id}")


class FakeModel:
    """TritonModel's interface: infer refuses batches holding a POISON row, or the whole server is down."""

    def __init__(self, shift: float = 0.0):
        self.shift = shift
        self.down = False
        self.calls: list[int] = []

    async def setup(self) -> None:
        if self.down:
            raise InferenceUnavailableError("down")

    async def is_ready(self) -> bool:
        return not self.down

    async def infer(self, batch: np.ndarray) -> np.ndarray:
        self.calls.append(len(batch))
        if self.down:
            raise InferenceUnavailableError("Triton is unavailable")
        if (batch[:, 1] == POISON).any():
            raise InferenceError("INVALID_ARG: refused")
        p = np.full((len(batch), 3), 0.1, dtype=np.float32)
        p[:, 0] = 0.8 - self.shift
        p[:, 1] = 0.1 + self.shift
        return p

    async def close(self) -> None:
        pass


class FakeRepository:
    """ModelRepository's interface (explicit model control): "serves" the fakes' versions, records loads and unloads."""

    def __init__(self, fakes: dict[ModelTarget, FakeModel]):
        self.fakes = fakes
        self.calls: list[tuple[str, str, list[str]]] = []

    async def serve(self, model: str, versions: set[str]) -> set[str]:
        self.calls.append(("serve", model, sorted(versions)))
        if any(self.fakes[ModelTarget(model, v)].down for v in versions):
            raise InferenceUnavailableError("Triton is unavailable")
        return set()

    async def retire(self, model: str, versions: set[str]) -> set[str]:
        self.calls.append(("retire", model, sorted(versions)))
        return set(versions)

    async def close(self) -> None:
        pass


def window(device: str, start: int, value: float = 1.0) -> dict:
    return {"device_id": device, "window_start": start, "window_end": start + 5000, "count": 50,
            "missing_rate": 0.0, **{name: value for name in FEATURE_NAMES if name not in ("missing_rate",)}}


def make_worker(**params) -> tuple[InferenceWorker, dict[ModelTarget, FakeModel]]:
    registry = FakeRegistry()
    settings = InferenceSettings.model_validate({"model": "anomaly", "features": FEATURE_NAMES,
                                                 "negative_class": "healthy", **params})
    worker = InferenceWorker(
        input_codec=AvroCodec(registry, "pm.features.device_window-value", load_schema("pm.features.device_window-value")),
        output_codec=AvroCodec(registry, "pm.predictions.anomaly-value", load_schema("pm.predictions.anomaly-value")),
        output_topic="pm.predictions.anomaly", dlq_topic="pm.dlq.inference", triton_url="unused:0",
        settings=settings, contract=ModelContract.from_config(PM / "model_repository" / "anomaly"),
        features=FEATURE_NAMES, shadow_topic=settings.shadow_topic,
    )
    fakes = {ModelTarget("anomaly", "1"): FakeModel(), ModelTarget("anomaly", "2"): FakeModel(shift=0.5)}
    worker.serving.models.update(fakes)
    worker.serving.repository = FakeRepository(fakes)
    return worker, fakes


def records(worker: InferenceWorker, windows: list[dict]) -> list[Record]:
    return [Record("pm.features.device_window", 0, offset, w["device_id"].encode(), worker.input_codec.encode(w),
                   {"trace_id": b"t" * 32, "event_id": f"{w['device_id']}:{w['window_start']}".encode()}, 0)
            for offset, w in enumerate(windows)]


def predictions(worker: InferenceWorker, outputs) -> list[dict]:
    return [worker.output_codec.decode(o.value) | {"topic": o.topic} for o in outputs if "dlq.reason" not in o.headers]


def test_every_prediction_names_its_version_and_the_canary_gets_its_share() -> None:
    worker, fakes = make_worker(routing={"production": "1", "challenger": "2", "canary_share": 0.3})
    batch = records(worker, [window(f"dev-{i}", 0) for i in range(1000)])
    got = predictions(worker, worker.process(batch))
    assert len(got) == 1000
    versions = [p["model_version"] for p in got]
    assert 0.25 < versions.count("2") / 1000 < 0.35
    assert all(p["event_id"].startswith(f"anomaly:{p['model_version']}:") for p in got)
    assert {p["topic"] for p in got} == {"pm.predictions.anomaly"}
    # one device, one version, batch after batch
    again = {p["device_id"]: p["model_version"] for p in predictions(worker, worker.process(batch))}
    assert again == {p["device_id"]: p["model_version"] for p in got}


def test_shadow_scores_a_copy_to_the_shadow_topic_only() -> None:
    worker, fakes = make_worker(routing={"production": "1", "challenger": "2", "mode": "shadow"},
                                shadow_topic="pm.predictions.anomaly_shadow")
    got = predictions(worker, worker.process(records(worker, [window(f"dev-{i}", 0) for i in range(10)])))
    acted = [p for p in got if p["topic"] == "pm.predictions.anomaly"]
    shadow = [p for p in got if p["topic"] == "pm.predictions.anomaly_shadow"]
    assert len(acted) == len(shadow) == 10
    assert {p["model_version"] for p in acted} == {"1"} and {p["model_version"] for p in shadow} == {"2"}
    # a challenger that is down never holds production back
    fakes[ModelTarget("anomaly", "2")].down = True
    got = predictions(worker, worker.process(records(worker, [window("dev-x", 0)])))
    assert [(p["topic"], p["model_version"]) for p in got] == [("pm.predictions.anomaly", "1")]


def test_triton_down_is_backpressure_not_a_dead_letter() -> None:
    worker, fakes = make_worker()
    fakes[ModelTarget("anomaly", "1")].down = True
    with pytest.raises(BackpressureError, match="unavailable"):
        worker.process(records(worker, [window("dev-1", 0)]))
    assert not worker.ready()
    fakes[ModelTarget("anomaly", "1")].down = False
    assert worker.ready()
    assert len(predictions(worker, worker.process(records(worker, [window("dev-1", 0)])))) == 1


def test_a_row_triton_keeps_refusing_goes_to_the_dlq_after_n_tries_and_the_others_flow() -> None:
    worker, fakes = make_worker(max_row_attempts=3)
    windows = [window(f"dev-{i}", 0) for i in range(16)]
    windows[5] = window("dev-5", 0, value=POISON)
    batch = records(worker, windows)
    for attempt in (1, 2):
        with pytest.raises(BackpressureError, match=rf"refused rows .*@5 \(try {attempt}/3\)"):
            worker.process(batch)
    outputs = worker.process(batch)
    dead = [o for o in outputs if "dlq.reason" in o.headers]
    assert len(dead) == 1 and dead[0].headers["dlq.reason"] == "inference_refused"
    assert dead[0].value == batch[5].value and dead[0].headers["dlq.source_offset"] == "5"
    assert sorted(p["device_id"] for p in predictions(worker, outputs)) == sorted(f"dev-{i}" for i in range(16) if i != 5)
    assert max(fakes[ModelTarget("anomaly", "1")].calls[-8:]) < 16  # found by bisection, not row by row
    assert worker.row_failures == {}


def test_undecodable_and_non_finite_rows_go_to_the_dlq_at_once() -> None:
    worker, _ = make_worker()
    good = records(worker, [window("dev-1", 0), window("dev-2", 0, value=float("nan"))])
    bad = Record("pm.features.device_window", 0, 9, b"dev-3", b"\x00garbage", {}, 0)
    outputs = worker.process([*good, bad])
    assert sorted(o.headers["dlq.reason"] for o in outputs if "dlq.reason" in o.headers) == ["bad_features", "undecodable"]
    assert len(predictions(worker, outputs)) == 1


def test_routing_file_switches_versions_between_batches(tmp_path) -> None:
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"production": "1"}))
    worker, fakes = make_worker(routing_file=str(path))
    batch = records(worker, [window("dev-1", 0)])
    assert predictions(worker, worker.process(batch))[0]["model_version"] == "1"
    assert ModelTarget("anomaly", "2") not in worker.serving.models  # not routed: its client is closed
    worker.serving.models[ModelTarget("anomaly", "2")] = fakes[ModelTarget("anomaly", "2")]  # "Triton serves it now"
    path.write_text(json.dumps({"production": "2"}) + " ")
    assert predictions(worker, worker.process(batch))[0]["model_version"] == "2"
    assert ModelTarget("anomaly", "1") not in worker.serving.models  # the version no longer routed is closed
    # load the new, switch, unload the old (explicit model control)
    assert worker.serving.repository.calls[-2:] == [("serve", "anomaly", ["2"]), ("retire", "anomaly", ["1"])]


class FixedLevel:
    """Stands in for the config center subscriber: the degradation level an operator switched to."""

    def __init__(self, level: str):
        self.level = level

    def get(self, namespace: str, key: str, default=None, entity=None):
        assert (namespace, key) == ("feature-switch", "degradation.level")
        return self.level


def test_degradation_l1_switches_the_challenger_off_and_l0_brings_it_back() -> None:
    worker, _ = make_worker(routing={"production": "1", "challenger": "2", "canary_share": 0.5}, follow_degradation=True)
    batch = records(worker, [window(f"dev-{i}", 0) for i in range(200)])
    worker.config = FixedLevel("L1")
    assert {p["model_version"] for p in predictions(worker, worker.process(batch))} == {"1"}
    worker.config = FixedLevel("L0")
    assert {p["model_version"] for p in predictions(worker, worker.process(batch))} == {"1", "2"}
