"""Helpers of the rule-processor integration tests: isolated topologies with chosen rule params,
an in-process processor thread, Avro producers of predictions and feature windows, an action reader."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import Consumer, Producer

from streams.avro import AvroCodec, codec
from streams.delivery import Runner, RunnerConfig
from streams.plan import apply
from streams.run import build_processor
from streams.settings import StackSettings
from streams.topology import Topology, load_topology
from reference import load_schema

from isolation import isolated_topology


def rules_topology(tmp_path: Path, stack: StackSettings, **params: Any) -> tuple[Topology, Path, str]:
    """An isolated copy of the reference topology whose rule processor's params are updated with ``params``.

    The copy also gets its own config topic, so its switches and rule sets touch no other test.
    """
    path, prefix = isolated_topology(tmp_path)
    raw = yaml.safe_load(path.read_text())
    rules = raw["processors"]["rules"]
    # the tests here produce predictions themselves, no feature stage writes rows: no wait for them
    rules["params"] = {**rules["params"], "config_topic": f"_tangram.config.{prefix}", "online_wait_ms": 0, **params}
    rules["max_wait_ms"] = 50
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    topology = load_topology(path)
    apply(topology, stack)
    return topology, path, prefix


class InProcess:
    """One processor of a topology running in a thread of the test (the real delivery loop)."""

    def __init__(self, topology: Topology, name: str, stack: StackSettings, group: str | None = None):
        spec = topology.processors[name]
        self.processor = build_processor(topology, name, stack)
        self.runner = Runner(self.processor, RunnerConfig(
            kafka=stack.kafka, group_id=group or topology.group(name),
            inputs=tuple(spec.inputs), batch_size=spec.batch_size, max_wait_ms=spec.max_wait_ms))
        self.thread = threading.Thread(target=self.runner.run, name=f"proc-{name}", daemon=True)

    def __enter__(self) -> InProcess:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.runner.stop()
        self.thread.join(30)


def prediction(device: str, window_end: int, label: str = "bearing_wear", score: float = 0.95,
               model: str = "anomaly", version: str = "1") -> dict:
    probs = {"healthy": 1 - score, "bearing_wear": 0.0, "overheating": 0.0}
    if label != "healthy":
        probs[label] = score
    return {"event_id": f"{model}:{version}:{device}:{window_end}", "device_id": device,
            "window_start": window_end - 5000, "window_end": window_end, "score": score, "label": label,
            "confidence": max(probs.values()), "probabilities": probs, "model_name": model,
            "model_version": version, "inference_ms": 3.0, "trace_id": uuid.uuid4().hex}


def window(device: str, window_end: int, **features: float) -> dict:
    schema = load_schema("pm.features.device_window-value")
    row: dict[str, Any] = {f["name"]: 0.0 for f in schema["fields"]}
    row.update(device_id=device, window_start=window_end - 5000, window_end=window_end, count=50,
               temperature_mean=60.0, vibration_mean=2.0, vibration_std=0.5, rpm_mean=1500.0)
    row.update(features)
    return row


class Feed:
    """Avro producer of the isolated topology's predictions and feature windows."""

    def __init__(self, stack: StackSettings, prefix: str):
        self.prefix = prefix
        self.producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True,
                                  "acks": "all", "linger.ms": 5})
        self.codecs: dict[str, AvroCodec] = {
            s: codec(stack.registry_url, s, load_schema(s))
            for s in ("pm.predictions.anomaly-value", "pm.features.device_window-value")}

    def predict(self, rows: list[dict], topic: str = "predictions.anomaly") -> None:
        for row in rows:
            self.producer.produce(f"{self.prefix}.{topic}", self.codecs["pm.predictions.anomaly-value"].encode(row),
                                  row["device_id"], headers=[("event_id", row["event_id"].encode())])
        self.flush()

    def windows(self, rows: list[dict]) -> None:
        for row in rows:
            self.producer.produce(f"{self.prefix}.features.device_window",
                                  self.codecs["pm.features.device_window-value"].encode(row), row["device_id"])
        self.flush()

    def flush(self) -> None:
        assert self.producer.flush(30) == 0, "records not acknowledged"


class Actions:
    """Reads the isolated topology's action topics from the beginning."""

    def __init__(self, stack: StackSettings, prefix: str):
        self.consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"reader-{uuid.uuid4().hex}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "isolation.level": "read_committed"})
        self.consumer.subscribe([f"{prefix}.actions.{k}" for k in ("maintenance", "alert", "review")])
        self.codec = codec(stack.registry_url, "pm.actions.maintenance-value", load_schema("pm.actions.maintenance-value"))
        self.seen: list[dict] = []

    def poll(self, seconds: float = 0.5) -> list[dict]:
        new = []
        for m in self.consumer.consume(1000, seconds):
            if m.error() is None:
                action = self.codec.decode(m.value())
                action["_topic"], action["_received"] = m.topic(), time.monotonic()
                new.append(action)
        self.seen += new
        return new

    def until(self, predicate, timeout_s: float = 30.0) -> list[dict]:
        """Poll until ``predicate(self.seen)`` holds; AssertionError with what was seen after the deadline."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.seen):
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s}s; {len(self.seen)} actions seen: "
                                     f"{[(a['rule'], a['device_id'], a['window_end']) for a in self.seen[-10:]]}")
            self.poll()
        return self.seen

    def settle(self, quiet_s: float = 2.0) -> list[dict]:
        """Poll until nothing new arrives for ``quiet_s``."""
        last = time.monotonic()
        while time.monotonic() - last < quiet_s:
            if self.poll():
                last = time.monotonic()
        return self.seen

    def close(self) -> None:
        self.consumer.close()
