"""Helpers of the gateway/DLQ integration tests: an isolated ingest topology, reading topics, free ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import yaml

from reference import SCHEMAS
from confluent_kafka import Consumer, TopicPartition

from streams.plan import apply
from streams.topology import Topology, load_topology

#: Servers these tests start themselves (mosquitto, the HTTP gateway) listen in 40100–40199.
PORT_RANGE = range(40100, 40200)


def free_port() -> int:
    """A port in ``PORT_RANGE`` nobody listens on now."""
    for port in PORT_RANGE:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")


@contextmanager
def mosquitto(conf: Path, port: int) -> Iterator[int]:
    """Mosquitto running ``conf`` (which listens on ``port``) until the block ends; fails if it does not start."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).is_file():
        pytest.fail("mosquitto is not installed; `make system-deps` installs it (apt-get install mosquitto)", pytrace=False)
    log_path = conf.with_suffix(".log")
    with log_path.open("wb") as log:
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mosquitto did not start on port {port}: {log_path.read_text()}")
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def ingest_topology(tmp_path: Path, stack, *, input_format: str = "json", params: dict | None = None,
                    gateway_params: dict | None = None, mqtt_topics: list[str] | None = None) -> tuple[Topology, str]:
    """A fresh topology (own topics, own group) with one ingest processor and a `telemetry` gateway, applied."""
    prefix = f"g{uuid.uuid4().hex[:8]}"
    raw = {"format": "json"} if input_format == "json" else {"schema": "pm.ingest.telemetry-value"}
    doc = {
        "app": prefix,
        "schemas": str(SCHEMAS),
        "defaults": {"partitions": 1},
        "topics": {
            f"{prefix}.raw.telemetry": raw,
            f"{prefix}.ingest.telemetry": {"schema": "pm.ingest.telemetry-value"},
            f"{prefix}.dlq.ingest": {"format": "bytes"},
        },
        "processors": {"ingest": {
            "kind": "streams.ingest:IngestValidator",
            "inputs": [f"{prefix}.raw.telemetry"], "outputs": [f"{prefix}.ingest.telemetry"],
            "dlq": f"{prefix}.dlq.ingest", "max_wait_ms": 50,
            "params": {"entity_field": "device_id", "time_field": "ts", "max_record_bytes": 1024,
                       "ranges": {"vibration": [0.0, 100.0]}, **(params or {})},
        }},
        "gateways": {"telemetry": {"processor": "ingest", "mqtt_topics": mqtt_topics or [f"{prefix}/telemetry/+"],
                                   "params": gateway_params or {}}},
    }
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    topology = load_topology(path)
    apply(topology, stack)
    return topology, prefix


def read_topic(stack, topic: str, *, at_least: int = 0, timeout_s: float = 30.0, idle_s: float = 1.0) -> list:
    """Every record of ``topic`` (partition 0 onwards), waiting until ``at_least`` arrived, then until idle."""
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    out: list = []
    deadline, last = time.monotonic() + timeout_s, time.monotonic()
    try:
        while time.monotonic() < deadline and (len(out) < at_least or time.monotonic() - last < idle_s):
            for msg in consumer.consume(1000, 0.2):
                if not msg.error():
                    out.append(msg)
                    last = time.monotonic()
    finally:
        consumer.close()
    assert len(out) >= at_least, f"{topic}: {len(out)} records, expected at least {at_least} within {timeout_s}s"
    return out


def headers(msg) -> dict[str, str]:
    return {k: v.decode("utf-8", "replace") for k, v in (msg.headers() or [])}
