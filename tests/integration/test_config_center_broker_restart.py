"""Registry and config survive a broker restart; live subscribers resume without a restart of their own.

This test stops and starts Kafka, so it runs its own broker (a free port pair in 40350–40399)
instead of the session's shared stack.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streams.config_center import ConfigCenter, ConfigSubscriber
from streams.errors import StackError
from streams.lifecycle import ModelRegistry, ModelRegistryWatcher
from streams.lifecycle.artifacts import sha256_file
from streams.settings import StackSettings
from streams.stack import down, up
from streams.stack.process import port_in_use

def _free_pair(host: str = "127.0.0.1") -> tuple[int, int]:
    for port in range(40350, 40399, 2):
        if not port_in_use(host, port) and not port_in_use(host, port + 1):
            return port, port + 1
    raise StackError("no free port pair in 40350..40399 for the private Kafka")


@pytest.fixture(scope="module")
def private_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    broker, controller = _free_pair()
    settings = StackSettings(home=tmp_path_factory.mktemp("restart-home"), kafka_port=broker,
                             kafka_controller_port=controller)
    try:
        up(settings, only=["kafka"])
    except StackError as exc:
        down(settings, only=["kafka"])
        pytest.fail(f"the private Kafka could not start: {exc}", pytrace=False)
    try:
        yield settings
    finally:
        down(settings, only=["kafka"])


def test_registry_and_config_survive_a_broker_restart(private_kafka: StackSettings, tmp_path: Path) -> None:
    bootstrap = private_kafka.kafka
    models, config = "_tangram.models", "_tangram.config"
    registry = ModelRegistry(bootstrap, models)
    for v in ("1", "2"):
        artifact = tmp_path / f"m{v}.onnx"
        artifact.write_bytes(f"model {v}".encode())
        registry.register({"name": "anomaly", "version": v, "sha256": sha256_file(artifact), "artifact": str(artifact),
                           "framework": "onnx", "owner": "ml", "license": "Apache-2.0", "dataset_version": "d1"}, "alice")
    registry.promote("anomaly", "1", "production", "alice", "")
    registry.promote("anomaly", "2", "challenger", "alice", "")
    registry.promote("anomaly", "2", "production", "alice", "", force=True)
    center = ConfigCenter(bootstrap, config)
    center.set("feature-switch", "degradation.level", "L1", "alice", "before restart")
    center.snapshot("pre-restart", "alice")
    routing_before, cells_before = registry.state.routing("anomaly"), center.state.cells()
    registry.close()
    center.close()

    watcher = ModelRegistryWatcher(bootstrap, models, name="across-restart").start()
    subscriber = ConfigSubscriber(bootstrap, config, name="across-restart").start()
    try:
        down(private_kafka, only=["kafka"])
        up(private_kafka, only=["kafka"])
        restarted = time.perf_counter()

        registry, center = ModelRegistry(bootstrap, models, timeout_s=30), ConfigCenter(bootstrap, config, timeout_s=30)
        assert registry.refresh().routing("anomaly") == routing_before
        assert center.refresh().cells() == cells_before and center.state.version == 1
        assert "pre-restart" in center.state.snapshots

        registry.rollback("anomaly", "oncall", "after the restart")
        change = center.set("feature-switch", "degradation.level", "L0", "oncall", "after the restart")
        watcher.wait_for("anomaly", lambda r: r.production is not None and r.production.version == "1", 30)
        subscriber.wait_version(change.version, 30)
        print(f"\nbroker restart: live watcher and subscriber applied the first changes "
              f"{time.perf_counter() - restarted:.1f} s after the broker was ready again")
        assert subscriber.get("feature-switch", "degradation.level") == "L0"
        registry.close()
        center.close()
    finally:
        watcher.stop()
        subscriber.stop()
