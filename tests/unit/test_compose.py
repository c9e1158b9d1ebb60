"""docker-compose.yml cannot run here (no Docker engine): check it against the topology instead."""

from pathlib import Path

import yaml

from streams import PROJECT_ROOT
from streams.topology import load_topology

COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
TOPOLOGY_FILE = "topologies/predictive_maintenance.yaml"


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
