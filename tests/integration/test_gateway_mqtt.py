"""MQTT ingest end to end: a real Mosquitto, the adapter, the real broker and registry."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from streams.avro import codec
from streams.gateway.mqtt import MqttGatewaySettings, serve
from reference import load_schema

from gateway_helpers import free_port, headers, ingest_topology, read_topic
from gateway_helpers import mosquitto as run_mosquitto

pytestmark = pytest.mark.integration

SUBJECT = "pm.ingest.telemetry-value"


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[int]:
    """A Mosquitto broker of this test on 127.0.0.1 (port in 40100-40199), anonymous; stopped afterwards."""
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    with run_mosquitto(conf, port):
        yield port


def reading(device: str, i: int, **over) -> dict:
    return {"event_id": f"{device}-{i}-{uuid.uuid4().hex[:6]}", "device_id": device, "ts": int(time.time() * 1000),
            "temperature": 60.0, "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0, **over}


def test_mqtt_readings_reach_kafka_validated_and_rejects_reach_the_dlq(stack, tmp_path, mosquitto):
    topic_root = f"t{uuid.uuid4().hex[:6]}/telemetry"
    topology, prefix = ingest_topology(tmp_path, stack, mqtt_topics=[f"{topic_root}/+"])
    path = tmp_path / f"{prefix}.yaml"
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve(path, None, stack, MqttGatewaySettings(port=mosquitto, client_id=f"gw-{prefix}"), stop)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    gateway = threading.Thread(target=run, daemon=True)
    gateway.start()

    device = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"dev-{prefix}")
    device.connect("127.0.0.1", mosquitto)
    device.loop_start()
    try:
        time.sleep(1.0)  # the adapter subscribes
        assert not errors, errors
        valid = []
        for i in range(20):
            r = reading("dev-m", i)
            valid.append(r["event_id"])
            device.publish(f"{topic_root}/dev-m", json.dumps(r), qos=1).wait_for_publish(5)
            if i == 5:
                device.publish(f"{topic_root}/dev-m", b'{"broken', qos=1).wait_for_publish(5)
            if i == 10:
                device.publish(f"{topic_root}/dev-m", json.dumps(reading("dev-m", 99, vibration=-3.0)), qos=1).wait_for_publish(5)
        device.publish(f"{topic_root}/dev-m", json.dumps(reading("dev-m", 0) | {"event_id": valid[0]}), qos=1).wait_for_publish(5)

        contract = codec(stack.registry_url, SUBJECT, load_schema(SUBJECT))
        ingested = read_topic(stack, f"{prefix}.ingest.telemetry", at_least=20)
        dead = read_topic(stack, f"{prefix}.dlq.ingest", at_least=2)
    finally:
        device.loop_stop()
        device.disconnect()
        stop.set()
        gateway.join(30)
    assert not gateway.is_alive() and not errors, errors
    assert [contract.decode(m.value())["event_id"] for m in ingested] == valid  # once each (the resend was a duplicate), in order
    assert {m.key() for m in ingested} == {b"dev-m"}
    assert all(len(headers(m)["trace_id"]) == 32 for m in ingested)
    assert sorted(headers(m)["dlq.reason"] for m in dead) == ["bad_json", "out_of_range"]
    broken = next(m for m in dead if headers(m)["dlq.reason"] == "bad_json")
    assert broken.value() == b'{"broken' and headers(broken)["dlq.source_topic"] == f"mqtt:{topic_root}/dev-m"
