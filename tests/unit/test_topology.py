import pytest
import yaml

from streams.errors import TopologyError
from streams.topology import Topology, load_topology

REFERENCE = "topologies/predictive_maintenance"


def test_reference_topology_round_trips_through_yaml():
    topology = load_topology(REFERENCE)
    again = Topology.model_validate(yaml.safe_load(topology.to_yaml()))
    assert again == topology
    assert again.to_yaml() == topology.to_yaml()


def test_reference_topology_declares_the_walking_skeleton():
    topology = load_topology(REFERENCE)
    assert list(topology.processors) == ["ingest", "features", "inference", "rules", "drift", "canary"]
    assert topology.processors["ingest"].dlq == "pm.dlq.ingest"
    assert topology.partitions("pm.ingest.telemetry") == 3
    assert topology.topics["pm.sim.labels"].configs()["cleanup.policy"] == "compact"
    assert topology.group("rules") == "pm.rules"
    assert set(topology.subjects()) >= {"pm.ingest.telemetry-value", "pm.predictions.anomaly-value"}


def _write(tmp_path, doc):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_undeclared_topic_is_named(tmp_path):
    doc = {"app": "x", "topics": {"x.in": {"format": "json"}},
           "processors": {"p": {"kind": "streams.ingest:IngestValidator", "inputs": ["x.in"], "outputs": ["x.missing"]}}}
    with pytest.raises(TopologyError, match="x.missing"):
        load_topology(_write(tmp_path, doc))


def test_avro_topic_needs_an_existing_schema_file(tmp_path):
    with pytest.raises(TopologyError, match="no schema file"):
        load_topology(_write(tmp_path, {"app": "x", "topics": {"x.a": {"schema": "nope-value"}}}))
    with pytest.raises(TopologyError, match="needs `schema"):
        load_topology(_write(tmp_path, {"app": "x", "topics": {"x.a": {"format": "avro"}}}))


def test_unknown_field_is_refused(tmp_path):
    with pytest.raises(TopologyError, match="partitionz"):
        load_topology(_write(tmp_path, {"app": "x", "topics": {"x.a": {"format": "json", "partitionz": 3}}}))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(TopologyError, match="does not exist"):
        load_topology(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("app: [unclosed")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(bad)


def test_the_pipeline_counts_as_drained_after_its_slowest_declared_call():
    """OCR on a CPU Triton takes seconds a batch: the demo and verify wait that long before calling it drained."""
    from reference import INTAKE
    from streams.launcher import quiet_period_s

    assert quiet_period_s(load_topology(INTAKE)) == 30.0  # the OCR stage's Triton deadline
    assert quiet_period_s(load_topology(REFERENCE)) == 5.0  # Redis' 5 s deadline over the 3 s floor


def test_min_insync_replicas_is_a_topic_config_from_the_topic_or_the_defaults(tmp_path):
    doc = {"app": "x", "defaults": {"replication_factor": 3, "min_insync_replicas": 2},
           "topics": {"x.in": {"format": "json"}, "x.out": {"format": "json", "min_insync_replicas": 3}},
           "processors": {"p": {"kind": "streams.ingest:IngestValidator", "inputs": ["x.in"], "outputs": ["x.out"]}}}
    topology = load_topology(_write(tmp_path, doc))
    assert topology.topic_configs("x.in") == {"cleanup.policy": "delete", "min.insync.replicas": "2"}
    assert topology.topic_configs("x.out")["min.insync.replicas"] == "3"
    assert "min.insync.replicas" not in load_topology(REFERENCE).topic_configs("pm.raw.telemetry")  # the broker's


def test_min_insync_replicas_above_the_replication_factor_is_refused(tmp_path):
    doc = {"app": "x", "defaults": {"min_insync_replicas": 2},
           "topics": {"x.in": {"format": "json"}, "x.out": {"format": "json"}},
           "processors": {"p": {"kind": "streams.ingest:IngestValidator", "inputs": ["x.in"], "outputs": ["x.out"]}}}
    with pytest.raises(TopologyError, match="min_insync_replicas 2 above its replication factor 1"):
        load_topology(_write(tmp_path, doc))
