"""docker-compose cannot run here (no Docker engine): its files are checked against the Compose
Specification's JSON schema and against the topology they deploy.

The schema is the compose-spec one that check-jsonschema ships (its ``vendor.compose-spec``), applied by jsonschema.
Beyond the schema: KRaft cluster ids, one service per processor running it, healthchecks behind every
``service_healthy``, Kafka's listeners for containers and for the host, Triton's model repository filled
before it starts, secrets by reference, and the Flink profile writing the online store.
"""

from __future__ import annotations

import base64
import binascii
import copy
import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from reference import IMAGE_APP, PM_TOPOLOGY as TOPOLOGY

from reference import REPO as PROJECT_ROOT
from streams.gateway.webapp import HEALTH_PATH
from streams.gateway.processes import LISTEN_PORTS, compose_service, gateway_command, gateway_processes
from streams.monitor.dashboards import PROCESSOR_METRICS_PORT
from streams.security.acls import gateway_principal
from streams.topology import load_topology

BASE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
KAFKA_3 = yaml.safe_load((PROJECT_ROOT / "docker-compose.kafka-3.yml").read_text())


def _compose_spec() -> dict:
    """The compose-spec schema check-jsonschema vendors, read as data without importing the package (its CLI
    module wants a newer click than Faust allows)."""
    package = Path(importlib.util.find_spec("check_jsonschema").origin).parent
    return json.loads((package / "builtin_schemas" / "vendor" / "compose-spec.json").read_text())


SCHEMA = _compose_spec()
VALIDATOR = jsonschema.validators.validator_for(SCHEMA)(SCHEMA, format_checker=jsonschema.FormatChecker())
SECRET_REF = re.compile(r"^\$\{[A-Z_]+:\?[^}]+\}$")  # `${VAR:?message}`: compose refuses to start without it


def _merge(base: dict, override: dict) -> dict:
    """docker compose's merge of `-f a.yml -f b.yml` for mappings; `ports` sequences are concatenated."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif key == "ports" and key in out:
            out[key] = [*out[key], *value]
        else:
            out[key] = value
    return out


MERGED = _merge(BASE, KAFKA_3)
FILES = {"docker-compose.yml": BASE, "docker-compose.kafka-3.yml": KAFKA_3, "both, merged": MERGED}


@pytest.mark.parametrize("name", FILES)
def test_compose_files_validate_against_the_compose_specification(name):
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(FILES[name])]
    assert not errors, "\n".join(errors)


def test_the_schema_is_not_vacuous():
    broken = copy.deepcopy(BASE)
    broken["services"]["ingest"]["depends_on"]["kafka"]["condition"] = "service_ready"
    broken["services"]["redis"]["healtcheck"] = broken["services"]["redis"].pop("healthcheck")
    messages = {e.message for e in VALIDATOR.iter_errors(broken)}
    assert any("service_ready" in m for m in messages) and any("healtcheck" in m for m in messages)


def _kafka_nodes(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("apache/kafka")}


@pytest.mark.parametrize("name", ["docker-compose.yml", "both, merged"])
def test_kraft_cluster_id_is_base64url_of_16_bytes(name):
    ids = {s["environment"]["CLUSTER_ID"] for s in _kafka_nodes(FILES[name]).values()}
    assert len(ids) == 1, "every node of one cluster formats its storage with the same id"
    cluster_id = ids.pop()
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cluster_id), cluster_id
    try:
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16
    except binascii.Error as exc:
        pytest.fail(f"CLUSTER_ID {cluster_id!r} is not base64url: {exc}")


def test_every_processor_of_the_topology_is_a_service_running_it():
    topology = load_topology(TOPOLOGY)
    services = BASE["services"]
    runners = {n for n, s in services.items() if s.get("command", [""])[0] == "run"}
    assert runners == set(topology.processors)
    for name in topology.processors:
        service = services[name]
        assert service["command"] == ["run", IMAGE_APP, name, "--metrics-port", str(PROCESSOR_METRICS_PORT)]
        assert service["build"] == "." and service["image"] == "tangram:latest"
        assert str(PROCESSOR_METRICS_PORT) in service["expose"] and "ports" not in service
        assert service["environment"]["TANGRAM_HOST"] == "0.0.0.0"  # Prometheus reaches /metrics from outside
        assert service["depends_on"]["apply"] == {"condition": "service_completed_successfully"}
        if topology.load_object(topology.processors[name].kind).needs_models:  # drift, inference: the artifacts
            assert "model-repository:/models:ro" in service["volumes"], name
            assert service["environment"]["TANGRAM_MODEL_REPOSITORY"] == "/models", name
        else:
            assert "volumes" not in service, name
    apply = services["apply"]
    # the models service fills the model server's repository; apply does topics and schemas
    assert apply["command"] == ["apply", IMAGE_APP, "--no-models"] and apply["restart"] == "no"


def test_triton_starts_on_a_model_repository_the_models_service_built():
    services = BASE["services"]
    triton, models = services["triton"], services["models"]
    assert models["command"] == ["models", "build", IMAGE_APP, "--repository", "/models"]
    assert models["restart"] == "no"
    volume = models["volumes"][0].split(":")[0]
    assert volume in BASE["volumes"], "a named volume, shared by the two services"
    assert f"{volume}:/models:ro" in triton["volumes"]
    assert triton["depends_on"]["models"] == {"condition": "service_completed_successfully"}
    assert "--model-repository=/models" in triton["command"]
    assert "--model-control-mode=explicit" in triton["command"]
    gpu = triton["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "ports" not in triton, "Triton's model control API stays on the compose network"
    assert services["inference"]["depends_on"]["triton"] == {"condition": "service_healthy"}


@pytest.mark.parametrize("name", ["docker-compose.yml", "both, merged"])
def test_depends_on_is_consistent(name):
    services = FILES[name]["services"]
    for service_name, service in services.items():
        deps = service.get("depends_on", {})
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for dep, how in deps.items():
            assert dep in services, f"{service_name} depends on {dep}, which is no service"
            assert set(services[dep].get("profiles", [])) <= set(service.get("profiles", [])), \
                f"{service_name} depends on {dep}, which only starts with profile {services[dep]['profiles']}"
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{service_name} waits for {dep} to be healthy: no healthcheck"
            if how["condition"] == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot; it must not restart"


def _published(service: dict) -> list[tuple[str, int, int]]:
    out = []
    for port in service.get("ports", []):
        ip, host, container = str(port).split(":")
        out.append((ip, int(host), int(container)))
    return out


@pytest.mark.parametrize("name", ["docker-compose.yml", "both, merged"])
def test_host_ports_are_loopback_only_and_unique(name):
    services = FILES[name]["services"]
    seen: dict[int, str] = {}
    for service_name, service in services.items():
        for ip, host, _ in _published(service):
            assert ip == "127.0.0.1", f"{service_name} publishes :{host} on every interface"
            assert host not in seen, f"host port {host}: {seen.get(host)} and {service_name}"
            seen[host] = service_name
    assert {"redis", "triton"}.isdisjoint(seen.values())


def _listeners(text: str) -> dict[str, tuple[str, int]]:
    out = {}
    for item in text.split(","):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        out[name] = (host, int(port))
    return out


@pytest.mark.parametrize("name", ["docker-compose.yml", "both, merged"])
def test_kafka_listeners_serve_containers_and_the_host(name):
    services = FILES[name]["services"]
    nodes = _kafka_nodes(FILES[name])
    for node, service in nodes.items():
        env = service["environment"]
        listeners, advertised = _listeners(env["KAFKA_LISTENERS"]), _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
        protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
        assert set(listeners) <= set(protocols)
        assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "INTERNAL"
        assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] not in advertised, "clients never see the controller"
        assert advertised["INTERNAL"] == (node, listeners["INTERNAL"][1]), "containers reach it by service name"
        host, port = advertised["EXTERNAL"]
        assert host == "localhost"
        assert ("127.0.0.1", port, listeners["EXTERNAL"][1]) in _published(service), \
            f"{node} advertises localhost:{port} to host clients: the host's :{port} must reach its EXTERNAL listener"
    internal = {f"{n}:{_listeners(s['environment']['KAFKA_ADVERTISED_LISTENERS'])['INTERNAL'][1]}"
                for n, s in nodes.items()}
    processor = services["ingest"]["environment"]
    assert f"{processor['TANGRAM_KAFKA_HOST']}:{processor['TANGRAM_KAFKA_PORT']}" in internal
    registry = services["schema-registry"]["environment"]["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"]
    assert set(registry.split(",")) == internal
    voters = {env["environment"]["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in nodes.values()}
    assert len(voters) == 1
    assert sorted(s["environment"]["KAFKA_NODE_ID"] for s in nodes.values()) == list(range(1, len(nodes) + 1))
    assert voters.pop() == ",".join(f"{s['environment']['KAFKA_NODE_ID']}@{n}:9093" for n, s in nodes.items())


def test_three_broker_profile_replicates_three_times():
    for env in (s["environment"] for s in _kafka_nodes(MERGED).values()):
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 3
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == 2
    registry = MERGED["services"]["schema-registry"]["environment"]
    assert registry["SCHEMA_REGISTRY_KAFKASTORE_TOPIC_REPLICATION_FACTOR"] == 3


def test_passwords_are_references_and_grafana_has_no_anonymous_admin():
    services = BASE["services"]
    redis_password = services["redis"]["environment"]["REDIS_PASSWORD"]
    assert SECRET_REF.match(redis_password)
    assert "--requirepass" in services["redis"]["command"][-1]
    assert "--appendonly yes --save ''" in services["redis"]["command"][-1]  # the AOF alone: no RDB fork a minute
    assert services["ingest"]["environment"]["TANGRAM_REDIS_PASSWORD"] == redis_password
    grafana = services["grafana"]["environment"]
    assert SECRET_REF.match(grafana["GF_SECURITY_ADMIN_PASSWORD"])
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_dockerfile_installs_the_cli_the_services_call():
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tangram"]' in dockerfile
    assert "COPY topologies" in dockerfile and "COPY schemas" in dockerfile


def test_flink_profile_runs_the_feature_job_and_writes_the_online_store():
    services = BASE["services"]
    jm, tm, job = services["flink-jobmanager"], services["flink-taskmanager"], services["flink-feature-job"]
    assert jm["command"] == ["jobmanager"] and tm["command"] == ["taskmanager"]
    assert {jm["profiles"][0], tm["profiles"][0], job["profiles"][0]} == {"flink"}
    assert "jobmanager.rpc.address: flink-jobmanager" in tm["environment"]["FLINK_PROPERTIES"]
    args = job["command"]
    assert args[:2] == ["flink", "run"] and args[args.index("--jobmanager") + 1] == "flink-jobmanager:8081"
    assert args[args.index("--pyModule") + 1] == "streams.flink.job"
    topology = load_topology(TOPOLOGY)
    assert args[args.index("--dlq") + 1] == topology.processors["features"].dlq
    feature_set = args[args.index("--feature-set") + 1]
    assert topology.path(topology.processors["features"].params["feature_set"]) == (PROJECT_ROOT / feature_set).resolve()
    assert (PROJECT_ROOT / feature_set).is_file()
    # the online store the rules read: the same Redis, password and Feast project as the embedded engine
    redis_url = args[args.index("--redis") + 1]
    password = services["redis"]["environment"]["REDIS_PASSWORD"]
    assert redis_url == f"redis://:{password}@redis:6379/0"
    assert args[args.index("--project") + 1] == topology.app
    assert job["depends_on"]["redis"] == {"condition": "service_healthy"}
    dockerfile = (PROJECT_ROOT / "Dockerfile.flink").read_text()
    pom = (PROJECT_ROOT / "streams" / "flink" / "pom.xml").read_text()
    jar = re.search(r"flink-sql-connector-kafka-([\d.]+-[\d.]+)\.jar", dockerfile).group(1)
    assert f"<version>{jar}</version>" in pom  # the cluster gets the connector the local job is tested with
    assert "requirements-flink.txt" in dockerfile


def test_every_gateway_process_of_the_topology_is_a_service_running_its_command():
    topology = load_topology(TOPOLOGY)
    services = BASE["services"]
    gateways = {n for n, s in services.items() if s.get("command", [""])[0] == "gateway"}
    processes = gateway_processes(topology)
    assert gateways == {compose_service(kind) for kind in processes} == {"gateway-http", "gateway-mqtt"}
    for kind, streams in processes.items():
        service = services[compose_service(kind)]
        assert service["command"] == gateway_command(kind, IMAGE_APP, streams, metrics_port=PROCESSOR_METRICS_PORT)
        assert service["image"] == "tangram:latest" and str(PROCESSOR_METRICS_PORT) in service["expose"]
        assert service["depends_on"]["apply"] == {"condition": "service_completed_successfully"}
        assert service["depends_on"]["kafka"] == {"condition": "service_healthy"}
    http = services["gateway-http"]
    port = LISTEN_PORTS["http"]
    assert _published(http) == [("127.0.0.1", port, port)]
    probe = " ".join(http["healthcheck"]["test"])
    assert f"http://localhost:{port}{HEALTH_PATH}" in probe and http["healthcheck"]["test"][:2] == ["CMD", "python"]
    mqtt = services["gateway-mqtt"]
    assert mqtt["profiles"] == ["mqtt"] and "ports" not in mqtt, "the adapter connects out to the broker only"
    env = mqtt["environment"]
    assert env["TANGRAM_MQTT_USERNAME"] == gateway_principal(topology)
    assert env["TANGRAM_MQTT_PASSWORD"] == "${TANGRAM_MQTT_PASSWORD:-}"  # a reference (required only with the profile)
    assert env["TANGRAM_KAFKA_HOST"] == "kafka", "the rest of its environment is the processors'"
