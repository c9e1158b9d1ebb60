"""The security pieces without a stack: the one Kafka config, generated grants, keys, the registry's and
Mosquitto's credentials, the secret store and the certificates."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import stat
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509

from reference import PM_TOPOLOGY
from streams.errors import StackError
from streams.gateway.errors import GatewayError
from streams.gateway.mqtt_auth import acl_text, device_pattern, password_line
from streams.gateway.quota import Limits, Quotas
from streams.registry.app import Registry, create_app
from streams.registry.auth import RegistryUsers, hash_password, verify_password
from streams.security.acls import principal_grants, processor_grants, processor_principal, redis_role
from streams.security.kafka import KafkaConnection, KafkaSecurity
from streams.security.keys import ApiKey, KeyRing, new_key, parse_token
from streams.security.local import identity_env, settings_as
from streams.security.pki import ensure_server_cert
from streams.security.secrets import SecretStore
from streams.settings import StackSettings, redact
from streams.topology import load_topology

SCRAM = KafkaSecurity(protocol="SASL_SSL", username="pm.ingest", password="p\"w", ca_file=Path("/ca.pem"))


# -- one Kafka config, three renderings ------------------------------------------------------------

def test_plaintext_is_the_default_and_sasl_ssl_needs_a_principal():
    assert KafkaConnection("h:1").config({"group.id": "g"}) == {
        "bootstrap.servers": "h:1", "security.protocol": "plaintext", "group.id": "g"}
    with pytest.raises(ValueError, match="username and a password"):
        KafkaSecurity(protocol="SASL_SSL", username="x")


def test_each_client_library_gets_the_same_security():
    rd = SCRAM.librdkafka()
    assert (rd["security.protocol"], rd["sasl.mechanism"], rd["sasl.username"], rd["sasl.password"],
            rd["ssl.ca.location"]) == ("sasl_ssl", "SCRAM-SHA-512", "pm.ingest", 'p"w', "/ca.pem")
    java = SCRAM.java(shaded=True)
    assert java["sasl.jaas.config"] == ('org.apache.flink.kafka.shaded.org.apache.kafka.common.security.scram.'
                                        'ScramLoginModule required username="pm.ingest" password="p\\"w";')
    assert java["ssl.truststore.type"] == "PEM" and java["ssl.truststore.location"] == "/ca.pem"
    auth = KafkaSecurity(protocol="SASL_SSL", username="u", password="p").aiokafka()  # the system's trust store
    assert auth["sasl_mechanism"] == "SCRAM-SHA-512" and isinstance(auth["ssl_context"], ssl.SSLContext)


def test_the_password_never_shows_in_messages():
    connection = KafkaConnection("h:1", SCRAM)
    assert "p\"w" not in str(connection) and "p\"w" not in repr(SCRAM)


def test_a_child_process_reads_back_the_settings_it_is_given(tmp_path, monkeypatch):
    stack = StackSettings(home=tmp_path, kafka_security=SCRAM, registry_username="r", registry_password="s@:/x")
    for key in [k for k in os.environ if k.startswith("TANGRAM_")]:
        monkeypatch.delenv(key)
    for key, value in stack.environ().items():
        monkeypatch.setenv(key, value)
    child = StackSettings()
    assert child.kafka.config() == stack.kafka.config()
    assert child.registry_url == stack.registry_url and redact(child.registry_url) == stack.registry_address
    assert KafkaSecurity.from_environ(os.environ) == SCRAM  # the Flink and Feast jobs read it the same way
    monkeypatch.setenv("TANGRAM_KAFKA_SECURITY__USERNAME", "other")
    assert StackSettings().kafka.security.username == "other"


def test_a_processor_on_the_secured_stack_wears_its_own_identity_never_the_operators(tmp_path):
    operator = StackSettings(home=tmp_path, secure=True)
    assert operator.kafka.security.username == "tangram-operator"
    env = identity_env(operator, "pm.rules", redis=True)
    assert env["TANGRAM_SECURE"] == "False" and json.loads(env["TANGRAM_KAFKA_SECURITY"])["username"] == "pm.rules"
    assert env["TANGRAM_REGISTRY_USERNAME"] == "tangram-reader" and env["TANGRAM_REDIS_USERNAME"] == "pm.rules"
    assert "TANGRAM_TRITON_CONTROL_KEY" not in env
    rules = settings_as(operator, "pm.rules")
    assert rules.redis_url.startswith("redis://127.0.0.1") and rules.triton_key is None  # no fallback
    assert identity_env(StackSettings(home=tmp_path), "pm.rules") == {}


# -- grants from the topology -------------------------------------------------------------------

def test_each_processor_reads_its_inputs_and_tables_writes_its_outputs_and_dlq_and_nothing_else():
    topology = load_topology(PM_TOPOLOGY)
    assert topology.processors["features"].tables == ["pm.devices"]
    for name, spec in topology.processors.items():
        grants = processor_grants(topology, name)
        reads = {g.name for g in grants if g.resource == "topic" and "READ" in g.operations and not g.prefixed}
        writes = {g.name for g in grants if "WRITE" in g.operations}
        assert reads == {*spec.inputs, *spec.tables}
        expected = {*spec.outputs, *([spec.dlq] if spec.dlq else [])}
        assert writes == (expected | {"_tangram.models"} if name == "canary" else expected), name
        assert {g.name for g in grants if g.prefixed} == {"_tangram.", "tangram-statelog-"}
        assert all(g.principal == processor_principal(topology, name) == f"pm.{name}" for g in grants)
    assert set(principal_grants(topology)) == {f"pm.{n}" for n in topology.processors} | {"pm.gateway"}
    assert {n: redis_role(topology, n) for n in topology.processors if redis_role(topology, n)} == {
        "features": "writer", "rules": "reader"}


# -- API keys -----------------------------------------------------------------------------------

class Subscriber:
    def __init__(self, records):
        self.records = records

    def get(self, namespace, key, default=None):
        return self.records.get(key, default)


def test_a_key_is_kept_as_a_hash_and_proves_its_identity_until_it_expires():
    made = new_key("site-7", "pm", ["telemetry"], expires_ms=2_000)
    assert made.token.startswith("tgk_") and parse_token(made.token) == (made.key_id, made.token.split("_", 2)[2])
    assert made.token.split("_", 2)[2] not in json.dumps(made.record.model_dump())
    ring = KeyRing(Subscriber({made.key_id: made.record.model_dump()}), clock=lambda: 1.0)
    identity = ring.authenticate(made.token)
    assert identity.name == "site-7" and identity.may_write("pm", "telemetry") and not identity.may_write("pm", "x")
    assert not identity.may_write("other", "telemetry")
    assert ring.authenticate(made.token[:-1] + ("A" if made.token[-1] != "A" else "B")) is None
    assert ring.authenticate("tgk_000000000000_" + "x" * 43) is None and ring.authenticate(None) is None
    assert KeyRing(Subscriber({made.key_id: made.record.model_dump()}), clock=lambda: 3.0).authenticate(made.token) is None
    with pytest.raises(ValueError):
        ApiKey(identity="bad identity", app="pm", streams=["t"], secret_sha256="0" * 64)


def test_quotas_charge_readings_and_dead_letters_per_identity():
    now = [0.0]
    quotas = Quotas("test", clock=lambda: now[0])
    limits = Limits(rate_per_s=10, burst=20, dlq_per_hour=3600)
    assert quotas.admit("a", limits, 20) == 0 and quotas.admit("a", limits, 1) > 0 and quotas.admit("b", limits, 20) == 0
    assert quotas.admit("a", limits, 21) == float("inf")
    assert quotas.dead_letters("a", limits, 3600) == 0 and quotas.dead_letters("a", limits, 1) == pytest.approx(1.0)
    now[0] = 1.0
    assert quotas.dead_letters("a", limits, 1) == 0 and quotas.exhausted("a", limits) == 0
    assert quotas.dead_letters("c", Limits(1, 1, 0), 1) == float("inf")


# -- the registry's users -----------------------------------------------------------------------

def test_registry_passwords_are_scrypt_hashes():
    encoded = hash_password("s3cret")
    assert encoded.startswith("scrypt$") and "s3cret" not in encoded and encoded != hash_password("s3cret")
    assert verify_password("s3cret", encoded) and not verify_password("s3cre", encoded)
    assert not verify_password("s3cret", "md5$abc") and not verify_password("s3cret", "scrypt$x$y")


def test_the_registry_refuses_strangers_and_the_reader_s_writes(tmp_path):
    users = RegistryUsers().with_user("admin", "admin", "a").with_user("reader", "read-only", "r")
    users.save(tmp_path / "users.json")
    assert stat.S_IMODE((tmp_path / "users.json").stat().st_mode) == 0o600
    app = create_app(Registry(None), RegistryUsers.load(tmp_path / "users.json"))

    def basic(user, password):
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    schema = {"schema": json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]})}

    async def calls():
        async with TestClient(TestServer(app)) as http:
            out = []
            for method, path, headers, body in [
                ("GET", "/subjects", {}, None), ("GET", "/subjects", basic("reader", "x"), None),
                ("GET", "/subjects", {"Authorization": "Basic !!"}, None),
                ("GET", "/subjects", basic("reader", "r"), None),
                ("POST", "/subjects/s-value/versions", basic("reader", "r"), schema),
                ("PUT", "/config/s-value", basic("reader", "r"), {"compatibility": "NONE"}),
                ("POST", "/subjects/s-value/versions", basic("admin", "a"), schema),
                ("POST", "/subjects/s-value", basic("reader", "r"), schema),
                ("DELETE", "/subjects/s-value?permanent=true", basic("reader", "r"), None),
            ]:
                async with http.request(method, path, headers=headers, json=body) as r:
                    out.append(r.status)
            return out

    assert asyncio.run(calls()) == [401, 401, 401, 200, 403, 403, 200, 200, 403]


# -- Mosquitto's files --------------------------------------------------------------------------

def test_mosquitto_passwords_are_pbkdf2_and_each_device_writes_its_own_topic():
    line = password_line("dev-1", "pw", salt=b"\x00" * 12)
    user, hashed = line.split(":", 1)
    _, scheme, iterations, salt, digest = hashed.split("$")
    assert (user, scheme, iterations, base64.b64decode(salt)) == ("dev-1", "7", "101", b"\x00" * 12)
    assert len(base64.b64decode(digest)) == 64 and "pw" not in hashed
    assert device_pattern("pm/telemetry/+") == "pm/telemetry/%u"
    assert device_pattern("site/+/dev/+/raw") == "site/+/dev/%u/raw"
    for bad in ("pm/telemetry", "pm/#"):
        with pytest.raises(GatewayError):
            device_pattern(bad)
    with pytest.raises(GatewayError):
        password_line("dev 1", "pw")
    text = acl_text(load_topology(PM_TOPOLOGY), "pm.gateway")
    assert "user pm.gateway\ntopic read pm/telemetry/+" in text and "pattern write pm/telemetry/%u" in text


# -- secrets and certificates -------------------------------------------------------------------

def test_a_secret_is_made_once_private_and_never_outside_its_folder(tmp_path):
    store = SecretStore(tmp_path / "s")
    first = store.get("kafka", "pm.ingest")
    assert first == store.get("kafka", "pm.ingest") and len(first.get_secret_value()) == 43
    assert stat.S_IMODE(store.path("kafka", "pm.ingest").stat().st_mode) == 0o600
    for kind, name in (("kafka", "../x"), ("..", "x"), ("kafka", "a/b"), ("kafka", "")):
        with pytest.raises(StackError):
            store.get(kind, name)


def test_the_broker_certificate_names_its_hosts_and_chains_to_the_ca(tmp_path):
    path = ensure_server_cert(tmp_path, "kafka", ["127.0.0.1", "localhost"])
    certs = x509.load_pem_x509_certificates(path.read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    certs[0].verify_directly_issued_by(ca)
    names = certs[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(n.value) for n in names} == {"127.0.0.1", "localhost"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600
    before = path.read_bytes()
    assert ensure_server_cert(tmp_path, "kafka", ["127.0.0.1", "localhost"]).read_bytes() == before  # still valid: kept
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    context.load_cert_chain(str(path))  # key and chain in one PEM file, as Kafka's PEM keystore reads it
    assert ensure_server_cert(tmp_path, "kafka", ["kafka"]).read_bytes() != before  # another host: renewed


def test_every_key_the_feature_engine_writes_is_within_its_redis_users_keys():
    """The writer's Redis user may touch ``~*<project>`` only: Feast's rows and the engine's progress hash."""
    import fnmatch

    from streams.features.layout import FeastLayout
    from streams.features.progress import progress_key
    from streams.features.spec import load_feature_set
    from streams.security.acls import redis_rules
    from streams.topology import load_topology

    topology = load_topology(PM_TOPOLOGY)
    spec = topology.processors["features"]
    layout = FeastLayout.of(load_feature_set(topology.path(spec.params["feature_set"])), topology.app)
    [pattern] = [rule[1:] for rule in redis_rules(topology.app, "writer") if rule.startswith("~")]
    keys = [progress_key(layout), layout.key("dev-0001")]
    assert all(fnmatch.fnmatchcase(key.decode("latin-1"), pattern) for key in keys), (pattern, keys)
