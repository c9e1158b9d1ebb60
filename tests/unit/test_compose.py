"""docker-compose.yml cannot run here (no Docker engine): check it against the topology instead."""

import re

import yaml

from reference import REPO as PROJECT_ROOT
from streams.topology import load_topology

COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
TOPOLOGY_FILE = "topologies/predictive_maintenance"


def test_every_processor_of_the_topology_is_a_service_running_it():
    topology = load_topology(PROJECT_ROOT / TOPOLOGY_FILE)
    services = COMPOSE["services"]
    for name in topology.processors:
        assert name in services, f"processor {name} has no service"
        command = services[name]["command"]
        assert command[:3] == ["run", TOPOLOGY_FILE, name]
        assert services[name]["build"] == "."
        assert services[name]["environment"]["TANGRAM_KAFKA_HOST"] == "kafka"


def test_infrastructure_services_match_the_local_stack():
    services = COMPOSE["services"]
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert "PLAINTEXT://kafka:9092" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    assert services["schema-registry"]["environment"]["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert "--appendonly" in services["redis"]["command"]
    triton = services["triton"]
    assert "./inference_workers/model_repository:/models:ro" in triton["volumes"]
    assert any("--model-repository=/models" in part for part in triton["command"])
    assert (PROJECT_ROOT / "inference_workers/model_repository/anomaly/config.pbtxt").is_file()


def test_dockerfile_installs_the_cli_the_services_call():
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tangram"]' in dockerfile
    assert "COPY topologies" in dockerfile and "COPY schemas" in dockerfile


def _merge(base: dict, override: dict) -> dict:
    """docker compose's merge for mappings (what `-f a.yml -f b.yml` does to these keys)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_three_broker_profile_is_a_consistent_kraft_quorum():
    override = yaml.safe_load((PROJECT_ROOT / "docker-compose.kafka-3.yml").read_text())
    services = _merge(COMPOSE, override)["services"]
    nodes = {name: services[name]["environment"] for name in ("kafka", "kafka-2", "kafka-3")}
    assert sorted(env["KAFKA_NODE_ID"] for env in nodes.values()) == [1, 2, 3]
    voters = {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in nodes.values()}
    assert voters == {"1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"}
    for name, env in nodes.items():
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 3
    registry = services["schema-registry"]["environment"]
    assert registry["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"].count("kafka") == 3


def test_flink_profile_submits_the_feature_job_to_a_jobmanager_and_taskmanager():
    services = COMPOSE["services"]
    jm, tm, job = services["flink-jobmanager"], services["flink-taskmanager"], services["flink-feature-job"]
    assert jm["command"] == ["jobmanager"] and tm["command"] == ["taskmanager"]
    assert {jm["profiles"][0], tm["profiles"][0], job["profiles"][0]} == {"flink"}
    assert "jobmanager.rpc.address: flink-jobmanager" in tm["environment"]["FLINK_PROPERTIES"]
    args = job["command"]
    assert args[:2] == ["flink", "run"] and args[args.index("--jobmanager") + 1] == "flink-jobmanager:8081"
    assert args[args.index("--pyModule") + 1] == "streams.flink.job"
    topology = load_topology(PROJECT_ROOT / TOPOLOGY_FILE)
    assert args[args.index("--dlq") + 1] == topology.processors["features"].dlq
    feature_set = args[args.index("--feature-set") + 1]
    assert topology.processors["features"].params["feature_set"] == feature_set
    assert (PROJECT_ROOT / feature_set).is_file()
    dockerfile = (PROJECT_ROOT / "Dockerfile.flink").read_text()
    pom = (PROJECT_ROOT / "stack" / "flink" / "pom.xml").read_text()
    jar = re.search(r"flink-sql-connector-kafka-([\d.]+-[\d.]+)\.jar", dockerfile).group(1)
    assert f"<version>{jar}</version>" in pom  # the cluster gets the connector the local job is tested with
    assert "requirements-flink.txt" in dockerfile
