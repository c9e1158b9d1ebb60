"""The inference worker follows the model registry live, and never serves an artifact whose digest differs."""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
import yaml

from inference_workers.worker import InferenceWorker
from streams.avro import codec
from streams.context import BuildContext
from streams.delivery import Record
from pm_app import FEATURE_NAMES
from streams.lifecycle import ModelRegistry
from streams.lifecycle.artifacts import card_fields, sha256_file
from streams.plan import apply
from streams.topology import load_topology
from reference import load_schema

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def windows(stack, n: int) -> list[Record]:
    c = codec(stack.registry_url, "pm.features.device_window-value", load_schema("pm.features.device_window-value"))
    out = []
    for i in range(n):
        row = {"device_id": f"dev-{i}", "window_start": 1_800_000_000_000, "window_end": 1_800_000_005_000, "count": 50,
               **{name: 1.0 for name in FEATURE_NAMES}}
        out.append(Record("t", 0, i, f"dev-{i}".encode(), c.encode(row), {"trace_id": b"0" * 32}, 0))
    return out


def test_worker_follows_the_registry_and_refuses_a_tampered_artifact(stack, tmp_path):
    topic = f"_tangram.models.t{uuid.uuid4().hex[:8]}"
    path, _ = isolated_topology(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["processors"]["inference"]["params"].update(follow_registry=True, registry_topic=topic)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    topology = load_topology(path)
    assert topology.processors["inference"].params["follow_registry"] is True
    apply(topology, stack)
    repo = stack.model_repository
    registry = ModelRegistry(stack.kafka, topic)
    card = {**card_fields(repo / "anomaly" / "model_card.json", repo), "owner": "ml-platform", "license": "Apache-2.0"}
    registry.register(card, "ci", "trained by make")
    registry.promote("anomaly", "1", "production", "ci", "first model")

    worker = InferenceWorker.build(BuildContext(topology, "inference", stack))
    worker.setup()  # takes Production from the registry, checks the artifact digest and the Triton contract
    try:
        assert worker.serving.plan.describe().startswith("production anomaly:1")
        out = worker.process(windows(stack, 4))
        assert len(out) == 4 and all(o.topic.endswith(".predictions.anomaly") for o in out)

        # v2: registered with its true digest, then replaced on disk before anyone serves it
        v2 = tmp_path / "anomaly" / "2" / "model.onnx"
        v2.parent.mkdir(parents=True)
        shutil.copy(repo / "anomaly" / "1" / "model.onnx", v2)
        fields = {**card, "version": "2", "artifact": str(v2),
                  "sha256": sha256_file(v2), "dataset_version": "sim-v2"}
        registry.register(fields, "ci", "retrained")
        v2.write_bytes(v2.read_bytes() + b"tampered")
        registry.promote("anomaly", "2", "production", "ci", "promote the tampered one", force=True)
        worker.serving.watcher.wait_for("anomaly", lambda r: r.production is not None and r.production.version == "2", 10)
        time.sleep(0.2)
        worker.idle()  # applies registry changes between batches
        assert worker.serving.plan.describe().startswith("production anomaly:1")  # never switched to v2
        out = worker.process(windows(stack, 2))
        predictions = [codec(stack.registry_url, "pm.predictions.anomaly-value",
                             load_schema("pm.predictions.anomaly-value")).decode(o.value) for o in out]
        assert {p["model_version"] for p in predictions} == {"1"}
    finally:
        worker.close()
        registry.close()
