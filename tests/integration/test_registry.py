"""The embedded schema registry against a real Kafka, driven by confluent-kafka's own client.

Kafka comes from the ``stack`` fixture (``stack.bootstrap_servers``); for development,
``TANGRAM_REGISTRY_TEST_BOOTSTRAP=host:port`` points at another broker instead. The test
starts its OWN registry process on port 28081 with a fresh topic, so it never shares a
topic with the stack's registry. No Kafka means failure, never a skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from reference import REPO as PROJECT_ROOT

pytestmark = pytest.mark.integration

PORT = 28081 + int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
URL = f"http://127.0.0.1:{PORT}"


def avro(fields: list[dict[str, Any]]) -> Schema:
    return Schema(json.dumps({"type": "record", "name": "Reading", "namespace": "pm.test", "fields": fields}), "AVRO")


V1 = avro([{"name": "device", "type": "string"}, {"name": "temp", "type": "double"}])
V2 = avro([{"name": "device", "type": "string"}, {"name": "temp", "type": "double"},
           {"name": "rpm", "type": ["null", "long"], "default": None}])
BAD = avro([{"name": "device", "type": "string"}, {"name": "temp", "type": "double"},
            {"name": "site", "type": "string"}])  # new field without default: not BACKWARD


@dataclass
class RegistryProcess:
    """A registry subprocess and what it needs to be restarted."""

    bootstrap: str
    topic: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streams.registry", "--host", "127.0.0.1", "--port", str(PORT),
             "--bootstrap", self.bootstrap, "--topic", self.topic],
            cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"registry exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                urllib.request.urlopen(URL + "/", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"registry not ready within {timeout_s}s:\n{self.log_path.read_text()}")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


@pytest.fixture(scope="module")
def bootstrap(request: pytest.FixtureRequest) -> str:
    """Kafka bootstrap servers: the env override, else the ``stack`` fixture. Fails if unreachable."""
    servers = os.environ.get("TANGRAM_REGISTRY_TEST_BOOTSTRAP") or request.getfixturevalue("stack").bootstrap_servers
    try:
        AdminClient({"bootstrap.servers": servers}).list_topics(timeout=15)
    except Exception as exc:  # KafkaException: broker down
        pytest.fail(f"Kafka at {servers} is unreachable: {exc}")
    return servers


@pytest.fixture(scope="module")
def registry(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    topic = f"_schemas_test_{uuid.uuid4().hex[:8]}"
    process = RegistryProcess(bootstrap, topic, tmp_path_factory.mktemp("registry") / "registry.log")
    process.start()
    yield process
    process.stop()
    AdminClient({"bootstrap.servers": bootstrap}).delete_topics([topic])


@pytest.fixture
def client(registry: RegistryProcess) -> Iterator[SchemaRegistryClient]:
    with SchemaRegistryClient({"url": URL}) as c:
        yield c


def subject() -> str:
    return f"pm.test.{uuid.uuid4().hex[:8]}-value"


def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        URL + path, json.dumps(body).encode(), {"Content-Type": "application/vnd.schemaregistry.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_topic_is_compacted_single_partition(registry: RegistryProcess) -> None:
    admin = AdminClient({"bootstrap.servers": registry.bootstrap})
    meta = admin.list_topics(registry.topic, timeout=10).topics[registry.topic]
    assert len(meta.partitions) == 1
    resource = ConfigResource(ConfigResource.Type.TOPIC, registry.topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    assert configs["cleanup.policy"].value == "compact"


def test_register_get_lookup_versions(client: SchemaRegistryClient) -> None:
    s, other = subject(), subject()
    schema_id = client.register_schema(s, V1)
    assert client.register_schema(s, V1) == schema_id
    with SchemaRegistryClient({"url": URL}) as fresh:  # no client cache
        assert fresh.register_schema(s, V1) == schema_id
        assert fresh.register_schema(other, V1) == schema_id  # same schema, other subject: same id
        assert json.loads(fresh.get_schema(schema_id).schema_str) == json.loads(V1.schema_str)
        found = fresh.lookup_schema(s, V1)
        assert (found.schema_id, found.version, found.subject) == (schema_id, 1, s)
        assert sorted((v.subject, v.version) for v in fresh.get_schema_versions(schema_id)) == sorted(
            [(s, 1), (other, 1)]
        )
    v2_id = client.register_schema(s, V2)
    assert v2_id != schema_id
    assert client.get_versions(s) == [1, 2]
    latest = client.get_latest_version(s)
    assert (latest.version, latest.schema_id) == (2, v2_id)
    assert client.get_version(s, 1).schema_id == schema_id
    assert s in client.get_subjects()
    with pytest.raises(SchemaRegistryError) as info:
        client.get_latest_version(subject())
    assert (info.value.http_status_code, info.value.error_code) == (404, 40401)
    with pytest.raises(SchemaRegistryError) as info:
        client.get_version(s, 9)
    assert info.value.error_code == 40402
    with pytest.raises(SchemaRegistryError) as info:
        client.get_schema(999_999)
    assert info.value.error_code == 40403


def test_incompatible_change_refused_with_409(client: SchemaRegistryClient) -> None:
    s = subject()
    client.register_schema(s, V1)
    assert client.test_compatibility(s, V2) is True
    assert client.test_compatibility(s, BAD) is False
    status, body = post(f"/compatibility/subjects/{s}/versions/latest?verbose=true", BAD.to_dict())
    assert status == 200 and body["is_compatible"] is False
    assert any("Reading.site" in m and "READER_FIELD_MISSING_DEFAULT_VALUE" in m for m in body["messages"])
    with pytest.raises(SchemaRegistryError) as info:
        client.register_schema(s, BAD)
    assert (info.value.http_status_code, info.value.error_code) == (409, 409)
    assert "Reading.site" in info.value.error_message
    status, body = post(f"/subjects/{s}/versions", {"schema": '{"type": "record", "name": "X"}'})
    assert (status, body["error_code"]) == (422, 42201)


def test_config_levels(client: SchemaRegistryClient) -> None:
    s = subject()
    client.register_schema(s, V1)
    assert client.get_compatibility() == "BACKWARD"
    assert client.get_compatibility(s) == "BACKWARD"
    assert client.set_compatibility(s, "none") == {"compatibility": "NONE"}
    assert client.get_compatibility(s) == "NONE"
    assert client.register_schema(s, BAD) > 0  # NONE lets it in
    assert client.delete_config(s).compatibility_level == "NONE"
    assert client.get_compatibility(s) == "BACKWARD"
    client.set_compatibility(level="FULL")
    try:
        assert client.get_compatibility() == "FULL"
    finally:
        client.set_compatibility(level="BACKWARD")
    with pytest.raises(SchemaRegistryError) as info:
        client.set_compatibility(s, "SIDEWAYS")
    assert info.value.error_code == 42203


def test_delete_soft_and_permanent(client: SchemaRegistryClient) -> None:
    s = subject()
    client.register_schema(s, V1)
    client.register_schema(s, V2)
    assert client.delete_version(s, 2) == 2
    assert client.get_versions(s) == [1]
    assert client.delete_version(s, 2, permanent=True) == 2
    assert client.delete_subject(s) == [1]
    assert s not in client.get_subjects()
    assert s in client.get_subjects(deleted=True)
    assert client.delete_subject(s, permanent=True) == [1]
    assert s not in client.get_subjects(deleted=True)


def test_avro_serde_round_trip_through_kafka(client: SchemaRegistryClient, registry: RegistryProcess) -> None:
    topic = f"pm.test.registry_{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": registry.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    try:
        serializer = AvroSerializer(client, V1.schema_str)
        value = {"device": "press-7", "temp": 81.5}
        payload = serializer(value, SerializationContext(topic, MessageField.VALUE))
        schema_id = client.get_latest_version(f"{topic}-value").schema_id
        assert payload[0] == 0 and int.from_bytes(payload[1:5], "big") == schema_id

        producer = Producer({"bootstrap.servers": registry.bootstrap, "enable.idempotence": True, "acks": "all"})
        producer.produce(topic, payload, b"press-7")
        assert producer.flush(30) == 0
        consumer = Consumer({"bootstrap.servers": registry.bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest"})
        consumer.subscribe([topic])
        try:
            msg = None
            deadline = time.monotonic() + 30
            while msg is None and time.monotonic() < deadline:
                msg = consumer.poll(1.0)
            assert msg is not None and msg.error() is None
        finally:
            consumer.close()
        with SchemaRegistryClient({"url": URL}) as fresh:  # resolves the id over HTTP
            deserializer = AvroDeserializer(fresh)
            assert deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE)) == value
    finally:
        admin.delete_topics([topic])


def test_restart_keeps_ids(registry: RegistryProcess) -> None:
    s = subject()
    with SchemaRegistryClient({"url": URL}) as c:
        id1, id2 = c.register_schema(s, V1), c.register_schema(s, V2)
        c.set_compatibility(s, "FULL")
        c.delete_version(s, 2)
    assert registry.stop() == 0  # SIGTERM: graceful
    registry.start()
    with SchemaRegistryClient({"url": URL}) as c:
        assert c.lookup_schema(s, V1).schema_id == id1
        assert c.register_schema(s, V1) == id1
        assert c.get_versions(s) == [1]
        assert c.get_versions(s, deleted=True) == [1, 2]
        assert json.loads(c.get_schema(id2).schema_str) == json.loads(V2.schema_str)
        assert c.get_compatibility(s) == "FULL"
        fresh_id = c.register_schema(subject(), avro([{"name": "other", "type": "int"}]))
        assert fresh_id > id2
