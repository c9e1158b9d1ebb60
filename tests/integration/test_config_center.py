"""The config center on a real Kafka topic: live push, refusal, history/restore, convergence, restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition
from prometheus_client import REGISTRY

from conftest import stack_env
from reference import REPO as PROJECT_ROOT
from streams.config_center import ConfigCenter, ConfigOp, ConfigSubscriber, Scope
from streams.errors import ConfigValidationError
from streams.settings import StackSettings


@pytest.fixture
def topic() -> str:
    return f"_tangram.config.t{uuid.uuid4().hex[:8]}"


def end_offset(stack: StackSettings, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"probe-{uuid.uuid4().hex[:6]}"})
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
    finally:
        consumer.close()


def test_a_change_reaches_every_subscriber_within_a_second(stack: StackSettings, topic: str) -> None:
    center = ConfigCenter(stack.kafka, topic)
    center.set("feature-switch", "degradation.level", "L0", "alice", "initial")
    subscribers = [ConfigSubscriber(stack.kafka, topic, name=f"proc-{i}-{topic[-8:]}",
                                    namespaces=["feature-switch"]).start() for i in range(3)]
    try:
        applied_at: dict[str, float] = {}
        for s in subscribers:
            s.on_change(lambda a, name=s.name: applied_at.__setitem__(name, time.perf_counter()))
        worst: list[float] = []
        for level in ("L2", "L1", "L3", "L0", "L2"):
            applied_at.clear()
            started = time.perf_counter()
            change = center.set("feature-switch", "degradation.level", level, "oncall", f"drill {level}")
            for s in subscribers:
                s.wait_version(change.version, 5)
                assert s.get("feature-switch", "degradation.level") == level
            worst.append(max(applied_at.values()) - started)
        print("\nconfig propagation to 3 subscribers (publish → applied in all), 5 changes: "
              + ", ".join(f"{w * 1000:.0f} ms" for w in worst))
        assert max(worst) < 1.0
        versions = {s.version for s in subscribers}
        assert versions == {6}
        gauge = REGISTRY.get_sample_value("tangram_config_version", {"subscriber": subscribers[0].name})
        assert gauge == 6 and subscribers[0].status()["version"] == 6
    finally:
        for s in subscribers:
            s.stop()


def test_an_invalid_change_is_refused_whole_and_nothing_is_applied(stack: StackSettings, topic: str) -> None:
    center = ConfigCenter(stack.kafka, topic)
    center.set("monitor-threshold", "latency_p95_ms", 200, "alice", "initial")
    with ConfigSubscriber(stack.kafka, topic, name=f"refuse-{topic[-8:]}") as subscriber:
        before = end_offset(stack, topic)
        with pytest.raises(ConfigValidationError, match="nothing was published"):
            center.change([ConfigOp(namespace="monitor-threshold", key="latency_p95_ms", value=150),
                           ConfigOp(namespace="feature-switch", key="enable_x", value="sometimes")], "bob", "")
        env = {**os.environ, **stack_env(stack)}
        refused = subprocess.run([sys.executable, "-m", "streams", "config", "set", "model-config", "anomaly",
                                  '{"timeout_ms": 0}', "--topic", topic], capture_output=True, text=True, env=env,
                                 cwd=PROJECT_ROOT, timeout=60)
        assert refused.returncode == 2 and "model-config/anomaly" in refused.stderr and "greater than 0" in refused.stderr
        time.sleep(0.3)
        assert end_offset(stack, topic) == before
        assert subscriber.version == 1 and subscriber.get("monitor-threshold", "latency_p95_ms") == 200.0


def test_history_snapshot_and_restore_round_trip(stack: StackSettings, topic: str) -> None:
    center = ConfigCenter(stack.kafka, topic)
    center.change([ConfigOp(namespace="monitor-threshold", key="error_rate_alert", value=0.02),
                   ConfigOp(namespace="monitor-threshold", key="latency_p95_ms", value=200),
                   ConfigOp(namespace="business-rule", key="pm", value={"rules": [
                       {"name": "bearing", "when": "score > 0.9", "action": "maintenance"}]})], "alice", "initial")
    center.snapshot("known-good", "alice", "before the cleanup")
    good = center.state.cells()
    center.delete("monitor-threshold", "error_rate_alert", "bob", "cleanup")  # the seeds' incident
    center.set("monitor-threshold", "latency_p95_ms", 350, "bob", "less noise")
    assert [d.text() for d in center.diff("known-good")] == [
        "- monitor-threshold/error_rate_alert (was 0.02)", "~ monitor-threshold/latency_p95_ms: 200.0 → 350.0"]
    with ConfigSubscriber(stack.kafka, topic, name=f"restore-{topic[-8:]}") as subscriber:
        restored = center.restore("known-good", "carol", "restore after the incident")
        subscriber.wait_version(restored.version, 5)
        assert subscriber.state.cells() == good and restored.change.restored_from == "known-good"
    fresh = ConfigCenter(stack.kafka, topic).refresh()
    assert [(a.version, a.change.author, a.change.reason) for a in fresh.history] == [
        (1, "alice", "initial"), (2, "bob", "cleanup"), (3, "bob", "less noise"), (4, "carol", "restore after the incident")]
    assert fresh.cells() == good and ConfigCenter(stack.kafka, topic).diff("known-good") == []
    env = {**os.environ, **stack_env(stack)}
    shown = subprocess.run([sys.executable, "-m", "streams", "config", "history", "monitor-threshold", "--topic", topic],
                           capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60)
    assert shown.returncode == 0 and "v4" in shown.stdout and "carol" in shown.stdout


def test_subscribers_converge_and_a_restarted_one_starts_from_the_latest(stack: StackSettings, topic: str) -> None:
    center = ConfigCenter(stack.kafka, topic)
    center.set("monitor-threshold", "vibration_alert", 7.0, "alice", "default")
    a = ConfigSubscriber(stack.kafka, topic, name=f"a-{topic[-8:]}").start()
    b = ConfigSubscriber(stack.kafka, topic, name=f"b-{topic[-8:]}").start()
    try:
        center.set("monitor-threshold", "vibration_alert", 5.0, "alice", "canary on dev-00*", Scope(prefix="dev-00"))
        last = center.set("monitor-threshold", "vibration_alert", 6.0, "alice", "10 % canary", Scope(share=0.1))
        for s in (a, b):
            s.wait_version(last.version, 5)
        assert a.state.cells() == b.state.cells() and a.version == b.version == 3
        assert a.get("monitor-threshold", "vibration_alert", entity="dev-0001") == 5.0
        values = [b.get("monitor-threshold", "vibration_alert", entity=f"m-{i}") for i in range(2000)]
        assert 0.07 < values.count(6.0) / len(values) < 0.13
        a.stop()
        center.set("monitor-threshold", "vibration_alert", 8.0, "alice", "while a was down")
        restarted = ConfigSubscriber(stack.kafka, topic, name=f"a2-{topic[-8:]}").start()
        try:
            b.wait_version(4, 5)
            assert restarted.version == 4 and restarted.get("monitor-threshold", "vibration_alert") == 8.0
            assert restarted.state.cells() == b.state.cells()
        finally:
            restarted.stop()
    finally:
        a.stop()
        b.stop()
