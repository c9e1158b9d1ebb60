import yaml

from reference import pm_doc
from streams.constraints import path, violations
from streams.topology import Topology

REFERENCE = pm_doc()


def variant(**edits) -> Topology:
    doc = yaml.safe_load(yaml.safe_dump(REFERENCE))
    for dotted, value in edits.items():
        *parents, leaf = dotted.split("/")
        node = doc
        for part in parents:
            node = node[part]
        node[leaf] = value
    return Topology.model_validate(doc)


def test_reference_topology_is_sound():
    assert violations(Topology.model_validate(REFERENCE)) == []


def test_path_follows_topics_through_processors():
    t = Topology.model_validate(REFERENCE)
    assert path(t, "pm.raw.telemetry", "pm.actions.maintenance") == ["ingest", "features", "inference", "rules"]
    assert path(t, "pm.actions.alert", "pm.raw.telemetry") is None


def test_batch_larger_than_the_model_accepts():
    [msg] = violations(variant(**{"processors/inference/batch_size": 2048}))
    assert "batch_size 2048 exceeds model 'anomaly' max_batch_size 1024" in msg


def test_deadlines_that_would_outlive_the_poll_interval():
    calls = [{"service": "triton", "timeout_ms": 100_000, "retries": 2}]
    [msg] = violations(variant(**{"processors/inference/calls": calls}))
    assert "300000 ms" in msg and "rebalance" in msg


def test_sla_tighter_than_the_batching_delays():
    [msg] = violations(variant(**{"sla/p99_ms": 20}))
    assert "ingest → features → inference → rules" in msg and "add up to 20 ms" in msg


def test_more_replicas_than_partitions():
    [msg] = violations(variant(**{"processors/rules/replicas": 5}))
    assert "5 replicas" in msg and "3 partitions" in msg


def test_baseline_rate_beyond_measured_capacity():
    [msg] = violations(variant(**{"processors/ingest/compute": {"max_rate_per_replica": 100, "target_utilization": 0.5}}))
    assert "baseline 200/s" in msg and "= 50/s" in msg


def test_canary_routing_needs_a_share():
    [msg] = violations(variant(**{"processors/inference/evolution": {"routing": "canary"}}))
    assert "canary_share" in msg
