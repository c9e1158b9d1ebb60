"""The model registry on a real Kafka topic: registration rules, artifacts, stages, canary, timed rollback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from reference import REPO as PROJECT_ROOT
from streams.errors import ArtifactIntegrityError
from streams.lifecycle import ModelRegistry, ModelRegistryWatcher, Stage
from streams.lifecycle.artifacts import sha256_file
from streams.lifecycle.canary import CanaryController
from streams.settings import StackSettings
from conftest import stack_env


@pytest.fixture
def topic() -> str:
    return f"_tangram.models.t{uuid.uuid4().hex[:8]}"


def version_fields(tmp_path: Path, version: str, payload: bytes | None = None) -> dict[str, Any]:
    artifact = tmp_path / "anomaly" / version / "model.onnx"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    artifact.write_bytes(payload or f"model {version}".encode())
    return {"name": "anomaly", "version": version, "sha256": sha256_file(artifact), "artifact": str(artifact),
            "framework": "onnx", "owner": "ml-platform", "license": "Apache-2.0", "dataset_version": f"sim-{version}",
            "training_metrics": {"accuracy": 0.99}, "evaluation": {"held_out": 2655}}


def cli(stack: StackSettings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack_env(stack)}
    return subprocess.run([sys.executable, "-m", "streams", *args], capture_output=True, text=True, env=env,
                          cwd=PROJECT_ROOT, timeout=60)


def test_registration_without_a_dataset_version_fails_and_writes_nothing(stack: StackSettings, topic: str,
                                                                          tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(PROJECT_ROOT / "topologies" / "predictive_maintenance" / "model_repository" / "anomaly", repo / "anomaly")
    card = json.loads((repo / "anomaly" / "model_card.json").read_text())
    del card["dataset_version"]
    (repo / "anomaly" / "model_card.json").write_text(json.dumps(card))
    refused = cli(stack, "models", "register", "--card", str(repo / "anomaly" / "model_card.json"),
                  "--owner", "ml-platform", "--license", "Apache-2.0", "--topic", topic)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "dataset_version is mandatory" in refused.stderr
    assert ModelRegistry(stack.kafka, topic).refresh().models == {}
    # the same card with its dataset version registers, from the CLI
    ok = cli(stack, "models", "register", "--card", str(repo / "anomaly" / "model_card.json"), "--dataset-version",
             card.get("dataset_version", "sim-v1-2c4104fe59e1"), "--owner", "ml-platform", "--license", "Apache-2.0",
             "--topic", topic, "--reason", "trained by tangram model train")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    state = ModelRegistry(stack.kafka, topic).refresh()
    assert state.version("anomaly", "1").sha256 == card["sha256"]


def test_a_tampered_artifact_is_never_loaded(stack: StackSettings, topic: str, tmp_path: Path) -> None:
    registry = ModelRegistry(stack.kafka, topic)
    registry.register(version_fields(tmp_path, "1"), "alice", "first")
    registry.promote("anomaly", "1", Stage.PRODUCTION, "alice", "bootstrap")
    with ModelRegistryWatcher(stack.kafka, topic, name="tamper") as watcher:
        ref = watcher.current("anomaly").production
        path = watcher.verified_path("anomaly", ref, tmp_path)
        path.write_bytes(path.read_bytes() + b"\x00")  # tampered after registration
        with pytest.raises(ArtifactIntegrityError, match="will not be loaded"):
            watcher.verified_path("anomaly", ref, tmp_path)


def test_promote_canary_production_is_recorded_and_a_bad_canary_rolls_back(stack: StackSettings, topic: str,
                                                                          tmp_path: Path) -> None:
    registry = ModelRegistry(stack.kafka, topic)
    for v in ("1", "2", "3"):
        registry.register(version_fields(tmp_path, v), "alice", f"trained v{v}")
    registry.promote("anomaly", "1", "production", "alice", "first model")
    registry.set_policy("anomaly", {"admission": {"min_shadow_events": 200, "metric": "accuracy", "margin": 0.005},
                                    "canary": {"initial_share": 0.01, "step": 0.05, "interval_s": 0.01,
                                               "min_events": 50}}, "alice", "declared")
    with ModelRegistryWatcher(stack.kafka, topic, name="stages") as watcher:
        registry.promote("anomaly", "2", "challenger", "bob", "retrained")
        assert watcher.wait_for("anomaly", lambda r: r.shadow and r.challenger is not None, 5).challenger.version == "2"
        registry.record_shadow("anomaly", "2", 250, "accuracy", 0.991, 0.990, "shadow-scorer", "shadow window 1")

        controller = CanaryController(registry, "anomaly", actor="canary-bot")
        assert controller.tick()[0] == "start"
        assert watcher.wait_for("anomaly", lambda r: r.canary_share == 0.01, 5)
        controller.observe_many("1", [0.92] * 100)
        controller.observe_many("2", [0.91] * 100)  # about 1 % lower: healthy
        time.sleep(0.02)
        action, verdict = controller.tick()
        assert action == "step" and verdict.healthy
        assert watcher.wait_for("anomaly", lambda r: abs(r.canary_share - 0.06) < 1e-9, 5)

        registry.promote("anomaly", "2", "production", "bob", "canary healthy, shadow within margin")
        routing = watcher.wait_for("anomaly", lambda r: r.production is not None and r.production.version == "2", 5)
        assert routing.challenger is None and routing.canary_share == 0

        registry.promote("anomaly", "3", "challenger", "bob", "next candidate")
        controller = CanaryController(registry, "anomaly", actor="canary-bot")
        controller.tick()
        controller.observe_many("2", [0.92] * 100)
        controller.observe_many("3", [0.85] * 100)  # 7.6 % lower: the seeds' rule rolls it back
        action, verdict = controller.tick()
        assert action == "rollback" and verdict.drop > 0.05
        routing = watcher.wait_for("anomaly", lambda r: r.challenger is None, 5)
        assert routing.production.version == "2"

    events = ModelRegistry(stack.kafka, topic).refresh().models["anomaly"].events
    summary = [(e.type, e.version, e.actor) for e in events if e.type != "registered"]
    assert summary == [
        ("transition", "1", "alice"), ("policy", None, "alice"), ("transition", "2", "bob"),
        ("shadow-evidence", "2", "shadow-scorer"), ("canary", "2", "canary-bot"), ("canary", "2", "canary-bot"),
        ("transition", "2", "bob"), ("transition", "3", "bob"), ("canary", "3", "canary-bot"),
        ("canary-rollback", "3", "canary-bot"),
    ]
    promoted = events[[e.type for e in events].index("transition", 6)]
    assert promoted.data["admission"]["passed"] and promoted.data["replaces"] == "1"
    assert "confidence p50" in events[-1].reason and events[-1].data["verdict"]["healthy"] is False
    assert all(e.at_ms > 0 for e in events)


def test_rollback_reaches_every_watcher_within_the_rto(stack: StackSettings, topic: str, tmp_path: Path) -> None:
    registry = ModelRegistry(stack.kafka, topic)
    for v in ("1", "2"):
        registry.register(version_fields(tmp_path, v), "alice", "")
    registry.promote("anomaly", "1", "production", "alice", "")
    registry.promote("anomaly", "2", "challenger", "alice", "")
    registry.promote("anomaly", "2", "production", "alice", "hotfix", force=True)
    watchers = [ModelRegistryWatcher(stack.kafka, topic, name=f"worker-{i}").start() for i in range(3)]
    try:
        seen: dict[str, float] = {}
        for w in watchers:
            w.on_change(lambda before, after, name=w.name: seen.setdefault(name, time.perf_counter())
                        if after.production and after.production.version == "1" else None)
        started = time.perf_counter()
        registry.rollback("anomaly", "oncall", "p99 latency up after v2")
        for w in watchers:
            w.wait_for("anomaly", lambda r: r.production is not None and r.production.version == "1", 10)
        elapsed = {name: t - started for name, t in seen.items()}
        worst = max(elapsed.values())
        print(f"\nrollback: previous production served by {len(elapsed)} watchers after "
              + ", ".join(f"{n} {s * 1000:.0f} ms" for n, s in sorted(elapsed.items())) + f" (worst {worst * 1000:.0f} ms)")
        assert len(elapsed) == 3
        assert worst < 5.0  # the aim; the seeds ask RTO < 30 s
    finally:
        for w in watchers:
            w.stop()
    cli_history = cli(stack, "models", "history", "anomaly", "--topic", topic)
    assert cli_history.returncode == 0 and "rollback: 2 → 1" in cli_history.stdout and "oncall" in cli_history.stdout
