"""Every door of the secured stack, tried without credentials, with wrong ones, and beyond a principal's grant.

Each door is refused, and each refusal is the component's own (an authentication failure, an
authorization failure, a 401/403), not a timeout. The same doors are listed in docs/security.md
(``DOORS`` here is the list; a unit test keeps the two in step). The keys that should open a door
are tried too, so a refusal is not the door being shut for everyone.
"""

from __future__ import annotations

import asyncio
import base64
import getpass
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import paho.mqtt.client as mqtt
import pytest
import redis
from aiohttp import web
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from inference_workers.triton_client import ModelRepository
from streams.config_center import ConfigCenter
from streams.errors import InferenceError
from streams.gateway import upload
from streams.gateway.http import HttpGatewaySettings, build_app
from streams.gateway.mqtt_auth import write_broker_files
from streams.namespace import namespaced
from streams.plan import apply
from streams.security import keys
from streams.security.acls import gateway_principal, processor_principal
from streams.security.local import REGISTRY_READER, settings_as
from streams.settings import OPERATOR
from streams.topology import load_topology

from gateway_helpers import free_port, mosquitto
from reference import INTAKE
from isolation import isolated_topology

pytestmark = pytest.mark.integration

#: The doors this test tries; docs/security.md lists the same ones.
DOORS = (
    "kafka: a client without credentials (PLAINTEXT against the SASL_SSL listener)",
    "kafka: a wrong password",
    "kafka: the controller listener without credentials",
    "kafka: a processor writing _tangram.config",
    "kafka: a processor writing _schemas",
    "kafka: a processor reading a topic it does not consume",
    "kafka: a processor joining another processor's consumer group",
    "kafka: a processor creating a topic",
    "registry: no credentials",
    "registry: a wrong password",
    "registry: the read-only user registering, deleting or changing compatibility",
    "redis: no credentials",
    "redis: a wrong password",
    "redis: a processor's user writing, listing keys, flushing, or reading another app's keys",
    "triton: model control (repository index, load, unload) without the key or with a wrong one",
    "gateway http: no key, a malformed key, a wrong secret, a revoked key, an expired key",
    "gateway http: a key for another stream or another app",
    "gateway upload: no key, a wrong secret, a key for another upload or another app",
    "gateway mqtt: anonymous, a wrong password",
    "gateway mqtt: a device publishing on another device's topic, or reading it",
)


@pytest.fixture(scope="module")
def app(secured_stack, tmp_path_factory):
    """An isolated copy of the reference app, applied on the secured stack: its principals and ACLs exist."""
    path, _ = isolated_topology(tmp_path_factory.mktemp("doors"))
    topology = load_topology(path)
    apply(topology, secured_stack)
    return topology


def refusal(conf: dict) -> list[KafkaError]:
    """The errors a client with ``conf`` gets asking for metadata (its own error last); fails if the broker answers."""
    errors: list[KafkaError] = []
    admin = AdminClient({**conf, "error_cb": errors.append, "socket.timeout.ms": 3000})
    with pytest.raises(KafkaException) as refused:
        admin.list_topics(timeout=6)
    admin.poll(1.0)  # serves the error callbacks: what the broker said
    return [*errors, refused.value.args[0]]


def produce_error(conf: dict, topic: str) -> KafkaError | None:
    """The delivery error of one record to ``topic`` (None: it was written)."""
    outcome: list[KafkaError | None] = []
    producer = Producer({**conf, "message.timeout.ms": 10_000})
    producer.produce(topic, b"x", b"k", on_delivery=lambda err, _msg: outcome.append(err))
    producer.flush(15)
    assert outcome, f"no delivery report for {topic}"
    return outcome[0]


# -- Kafka ------------------------------------------------------------------------------------

def test_kafka_refuses_clients_without_credentials_or_with_wrong_ones(secured_stack, app):
    plain = {"bootstrap.servers": secured_stack.bootstrap_servers}
    assert refusal(plain)  # the listener speaks TLS and SASL only: the handshake fails
    wrong = secured_stack.kafka.config({"sasl.password": "not-the-password"})
    assert any(e.code() == KafkaError._AUTHENTICATION for e in refusal(wrong))
    controller = {"bootstrap.servers": f"{secured_stack.host}:{secured_stack.kafka_controller_port}"}
    assert refusal(controller)
    assert AdminClient(secured_stack.kafka.config()).list_topics(timeout=10).topics  # the operator's credentials open it


def test_a_processor_principal_gets_its_grants_and_nothing_else(secured_stack, app):
    ingest = settings_as(secured_stack, processor_principal(app, "ingest")).kafka
    spec = app.processors["ingest"]
    assert produce_error(ingest.config(), spec.outputs[0]) is None  # its own output: written
    for topic in ("_tangram.config", "_schemas", app.processors["rules"].outputs[0]):
        err = produce_error(ingest.config(), topic)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, (topic, err)

    actions = app.processors["rules"].outputs[0]
    described = AdminClient(ingest.config()).list_topics(actions, timeout=15).topics[actions]
    assert described.error is not None and described.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    reader = Consumer(ingest.config({"group.id": app.group("ingest"), "enable.auto.commit": False}))
    with pytest.raises(KafkaException):  # not even where the rules' actions end
        reader.get_watermark_offsets(TopicPartition(actions, 0), timeout=15)
    assert reader.get_watermark_offsets(TopicPartition(spec.inputs[0], 0), timeout=15)  # its own input: answered
    reader.close()

    other_group = Consumer(ingest.config({"group.id": app.group("rules"), "enable.auto.commit": False}))
    other_group.subscribe([spec.inputs[0]])
    deadline, refused = time.monotonic() + 15, None
    while refused is None and time.monotonic() < deadline:
        msg = other_group.poll(0.5)
        if msg is not None and msg.error():
            refused = msg.error()
    other_group.close()
    assert refused is not None and refused.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, refused

    admin = AdminClient(ingest.config())  # held: a client collected mid-request fails its futures with _DESTROY
    future = admin.create_topics([NewTopic(f"{app.app}.sneaky", 1, 1)])[f"{app.app}.sneaky"]
    with pytest.raises(KafkaException) as exc:
        future.result(timeout=15)
    assert exc.value.args[0].code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED)


# -- the schema registry ------------------------------------------------------------------------

def http(method: str, url: str, user: str | None = None, password: str | None = None, body: dict | None = None,
         headers: dict | None = None) -> int:
    request = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/vnd.schemaregistry.v1+json", **(headers or {})})
    if user is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_registry_wants_basic_auth_and_the_reader_only_reads(secured_stack, app):
    base = secured_stack.registry_address
    reader = secured_stack.secrets.get("registry", REGISTRY_READER).get_secret_value()
    admin = secured_stack.secrets.get("registry", OPERATOR).get_secret_value()
    assert http("GET", f"{base}/subjects") == 401
    assert http("GET", f"{base}/subjects", REGISTRY_READER, "wrong") == 401
    assert http("GET", f"{base}/subjects", "nobody", reader) == 401
    assert http("GET", f"{base}/subjects", REGISTRY_READER, reader) == 200
    subject = f"{app.app}.doors-value"
    schema = {"schema": json.dumps({"type": "record", "name": "D", "fields": [{"name": "a", "type": "int"}]})}
    assert http("POST", f"{base}/subjects/{subject}/versions", REGISTRY_READER, reader, schema) == 403
    assert http("PUT", f"{base}/config/{subject}", REGISTRY_READER, reader, {"compatibility": "NONE"}) == 403
    existing = next(iter(app.subjects()))
    assert http("DELETE", f"{base}/subjects/{existing}?permanent=true", REGISTRY_READER, reader) == 403
    assert http("POST", f"{base}/subjects/{existing}", REGISTRY_READER, reader,
                {"schema": app.subjects()[existing]}) == 200  # a lookup is a read
    assert http("POST", f"{base}/subjects/{subject}/versions", OPERATOR, admin, schema) == 200


# -- Redis ----------------------------------------------------------------------------------------

def test_redis_wants_a_user_and_confines_each_processor(secured_stack, app):
    host, port = secured_stack.host, secured_stack.redis_port
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=port, username=OPERATOR, password="wrong").ping()
    rules = redis.Redis.from_url(settings_as(secured_stack, processor_principal(app, "rules"), redis=True).redis_url)
    features = redis.Redis.from_url(settings_as(secured_stack, processor_principal(app, "features"), redis=True).redis_url)
    assert rules.ping() and features.ping()
    mine = f"entity-{app.app}".encode()
    assert features.hset(mine, "f", "1") == 1 and rules.hget(mine, "f") == b"1"  # its own app's keys
    with pytest.raises(redis.exceptions.NoPermissionError):
        rules.hset(mine, "f", "2")  # the rules read, never write
    for command in (("KEYS", "*"), ("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            features.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):
        features.hget(b"entity-otherapp", "f")  # another app's key


# -- Triton ---------------------------------------------------------------------------------------

def test_triton_model_control_wants_the_key(secured_stack, app):
    async def index(key: str | None) -> list:
        async with ModelRepository(secured_stack.triton_grpc_url, timeout_s=10.0, control_key=key) as repository:
            return await repository.index()

    for key in (None, "wrong-key"):
        with pytest.raises(InferenceError, match="restricted"):
            asyncio.run(index(key))
    assert any(v.model == "anomaly" for v in asyncio.run(index(secured_stack.triton_key)))
    url = f"http://{secured_stack.triton_http_url}/v2/repository/models/anomaly/unload"
    assert http("POST", url, body={}) == 403
    assert http("POST", url, body={}, headers={"tangram-model-control": "wrong-key"}) == 403
    assert http("GET", f"http://{secured_stack.triton_http_url}/v2/health/ready") == 200  # inference stays open


# -- the HTTP gateway -----------------------------------------------------------------------------

def reading(device: str = "dev-d") -> dict:
    return {"event_id": uuid.uuid4().hex, "device_id": device, "ts": int(time.time() * 1000), "temperature": 60.0,
            "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0}


def test_the_http_gateway_wants_a_valid_key_for_the_stream(secured_stack, app):
    center = ConfigCenter(secured_stack.kafka)
    good = keys.create(center, "site-a", app.app, ["telemetry"], author="doors")
    elsewhere = keys.create(center, "site-b", app.app, ["another-stream"], author="doors")
    other_app = keys.create(center, "site-c", "another-app", ["telemetry"], author="doors")
    expired = keys.create(center, "site-d", app.app, ["telemetry"], author="doors", expires_ms=1)
    revoked = keys.create(center, "site-e", app.app, ["telemetry"], author="doors")
    wrong_secret = good.token[:-4] + ("AAAA" if not good.token.endswith("AAAA") else "BBBB")
    gateway_stack = settings_as(secured_stack, gateway_principal(app))
    settings = HttpGatewaySettings(port=free_port())

    async def calls() -> dict[str, int]:
        runner = web.AppRunner(build_app(app, None, gateway_stack, settings))
        await runner.setup()
        await web.TCPSite(runner, settings.host, settings.port).start()
        url = f"http://{settings.host}:{settings.port}/v1/streams/telemetry/events"
        out: dict[str, int] = {}
        try:
            async with aiohttp.ClientSession() as session:
                async def post(name: str, token: str | None) -> None:
                    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
                    async with session.post(url, json=reading(), headers=headers) as r:
                        out[name] = r.status

                await post("no key", None)
                await post("malformed", "hunter2")
                await post("wrong secret", wrong_secret)
                await post("expired", expired.token)
                await post("another stream", elsewhere.token)
                await post("another app", other_app.token)
                await post("valid", good.token)
                await post("before revocation", revoked.token)
                keys.revoke(center, revoked.key_id, author="doors", reason="test")
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    await post("revoked", revoked.token)
                    if out["revoked"] == 401:
                        break
                    await asyncio.sleep(0.2)
        finally:
            await runner.cleanup()
        return out

    answers = asyncio.run(calls())
    assert answers == {"no key": 401, "malformed": 401, "wrong secret": 401, "expired": 401, "another stream": 403,
                       "another app": 403, "valid": 200, "before revocation": 200, "revoked": 401}, answers
    history = center.refresh().changes_of(keys.NAMESPACE)
    assert [c.change.author for c in history][-1] == "doors" and history[-1].change.reason == "test"


def test_the_upload_gateway_wants_a_valid_key_for_the_upload(secured_stack, tmp_path):
    """The document-intake app's upload, its gateway running as the app's gateway principal: only a key for
    that upload gets a file onto its topic (which the principal's grants let it write)."""
    prefix = f"d{uuid.uuid4().hex[:8]}"
    intake = load_topology(namespaced(INTAKE, prefix, tmp_path / "topology.yaml"))
    apply(intake, secured_stack, models=False)
    center = ConfigCenter(secured_stack.kafka)
    good = keys.create(center, "counter-07", intake.app, ["documents"], author="doors")
    other_upload = keys.create(center, "counter-08", intake.app, ["scans"], author="doors")
    other_app = keys.create(center, "counter-09", "another-app", ["documents"], author="doors")
    wrong_secret = good.token[:-4] + ("AAAA" if not good.token.endswith("AAAA") else "BBBB")
    gateway_stack = settings_as(secured_stack, gateway_principal(intake))
    settings = upload.UploadGatewaySettings(port=free_port())

    async def calls() -> dict[str, int]:
        runner = web.AppRunner(upload.build_app(intake, gateway_stack, settings))
        await runner.setup()
        await web.TCPSite(runner, settings.host, settings.port).start()
        url = f"http://{settings.host}:{settings.port}/v1/uploads/documents"
        out: dict[str, int] = {}
        try:
            async with aiohttp.ClientSession() as session:
                for name, token in (("no key", None), ("wrong secret", wrong_secret), ("another upload", other_upload.token),
                                    ("another app", other_app.token), ("valid", good.token)):
                    form = aiohttp.FormData()
                    form.add_field("image", b"\x89PNG not much of a scan", filename="card.png", content_type="image/png")
                    headers = {"X-Device-ID": "counter-07", **({"Authorization": f"Bearer {token}"} if token else {})}
                    async with session.post(url, data=form, headers=headers) as r:
                        out[name] = r.status
        finally:
            await runner.cleanup()
        return out

    answers = asyncio.run(calls())
    assert answers == {"no key": 401, "wrong secret": 401, "another upload": 403, "another app": 403, "valid": 202}, answers


# -- the MQTT broker ------------------------------------------------------------------------------

@pytest.fixture
def secured_mosquitto(app, secured_stack, tmp_path) -> Iterator[tuple[int, dict[str, str]]]:
    """Mosquitto with the app's generated password and ACL files; yields its port and the passwords."""
    port = free_port()
    gateway = gateway_principal(app)
    passwords = {gateway: uuid.uuid4().hex, "dev-1": uuid.uuid4().hex, "dev-2": uuid.uuid4().hex}
    devices = {u: p for u, p in passwords.items() if u != gateway}
    files = write_broker_files(app, tmp_path / "mqtt", gateway, passwords[gateway], devices,
                               listener=f"{port} 127.0.0.1", run_as=getpass.getuser())
    with mosquitto(files.conf, port):
        yield port, passwords


def mqtt_client(port: int, user: str | None, password: str | None) -> tuple[mqtt.Client, dict]:
    state: dict = {"messages": []}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"doors-{uuid.uuid4().hex[:8]}")
    if user is not None:
        client.username_pw_set(user, password)
    client.on_connect = lambda c, u, f, rc, p: state.setdefault("connect", rc)
    client.on_subscribe = lambda c, u, mid, rcs, p: state.setdefault("subscribe", rcs)
    client.on_message = lambda c, u, msg: state["messages"].append(msg.topic)
    client.connect("127.0.0.1", port)
    client.loop_start()
    deadline = time.monotonic() + 5
    while "connect" not in state and time.monotonic() < deadline:
        time.sleep(0.05)
    return client, state


def test_mosquitto_wants_users_and_keeps_each_device_on_its_topic(app, secured_mosquitto):
    port, passwords = secured_mosquitto
    (base,) = app.gateways["telemetry"].mqtt_topics
    for user, password in ((None, None), ("dev-1", "wrong")):
        client, state = mqtt_client(port, user, password)
        client.loop_stop()
        assert state.get("connect") is not None and state["connect"].is_failure, (user, state)
    topic = {d: base.replace("+", d) for d in ("dev-1", "dev-2")}
    gateway, gateway_state = mqtt_client(port, gateway_principal(app), passwords[gateway_principal(app)])
    gateway.subscribe(base, qos=1)
    dev1, dev1_state = mqtt_client(port, "dev-1", passwords["dev-1"])
    dev1.subscribe(topic["dev-2"], qos=1)  # Mosquitto grants it, and delivers nothing it may not read
    dev2, _ = mqtt_client(port, "dev-2", passwords["dev-2"])
    deadline = time.monotonic() + 5
    while ("subscribe" not in dev1_state or "subscribe" not in gateway_state) and time.monotonic() < deadline:
        time.sleep(0.05)
    dev1.publish(topic["dev-2"], b"{}", qos=1).wait_for_publish(5)  # speaking for dev-2: dropped
    dev1.publish(topic["dev-1"], b"{}", qos=1).wait_for_publish(5)  # its own topic: delivered
    dev2.publish(topic["dev-2"], b"{}", qos=1).wait_for_publish(5)  # dev-2's own: to the gateway, not to dev-1
    deadline = time.monotonic() + 5
    while len(gateway_state["messages"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # anything else in flight arrives meanwhile
    for client in (gateway, dev1, dev2):
        client.loop_stop()
        client.disconnect()
    assert sorted(gateway_state["messages"]) == [topic["dev-1"], topic["dev-2"]]
    assert dev1_state["messages"] == []


def test_the_doors_are_the_ones_the_security_page_lists():
    page = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    missing = [door for door in DOORS if door not in page]
    assert not missing, f"docs/security.md does not list: {missing}"

