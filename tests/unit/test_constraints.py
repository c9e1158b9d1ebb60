import yaml

from reference import INTAKE, pm_doc
from streams.constraints import path, violations
from streams.topology import Topology, load_topology

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


def test_the_document_intake_topology_is_sound_with_its_own_kinds():
    """The second reference app's stages declare the services they call and that OCR follows live config."""
    assert violations(load_topology(INTAKE)) == []


def test_a_custom_kind_reloading_live_still_needs_its_live_config():
    doc = yaml.safe_load((INTAKE / "topology.yaml").read_text())
    doc["processors"]["ocr"]["params"]["live_config"] = False
    topology = Topology.model_validate({**doc, "root": str(INTAKE)})
    [msg] = violations(topology)
    assert "'ocr' declares hot_reload" in msg


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
    assert "300300 ms" in msg and "300000" in msg and "rebalance" in msg


def test_a_call_declared_for_a_service_the_processor_never_calls_is_refused():
    calls = [{"service": "http", "timeout_ms": 1000}]
    [msg] = violations(variant(**{"processors/features/calls": calls}))
    assert "declares http calls" in msg and "calls redis, registry" in msg


def test_a_fallback_nothing_executes_is_refused():
    calls = [{"service": "triton", "timeout_ms": 2000, "fallback": "rules-only"}]
    [msg] = violations(variant(**{"processors/inference/calls": calls}))
    assert "fallback 'rules-only'" in msg and "degradation" in msg


def test_hot_reload_and_rollback_rto_need_a_worker_that_follows_the_registry():
    params = {k: v for k, v in REFERENCE["processors"]["inference"]["params"].items()
              if k not in ("follow_registry", "follow_degradation")}
    msgs = violations(variant(**{"processors/inference/params": params}))
    assert len(msgs) == 2 and "hot_reload" in msgs[0] and "rollback_rto_s 5" in msgs[1]
    [msg] = violations(variant(**{"processors/features/state": {"hot_reload": True}}))
    assert "'features' declares hot_reload" in msg


def test_models_per_server_is_a_worker_limit_with_room_for_a_switch():
    [msg] = violations(variant(**{"processors/rules/state": {"models_per_server": 2}}))
    assert "loads no model" in msg
    msgs = violations(variant(**{"processors/inference/state": {"models_per_server": 1, "hot_reload": True}}))
    assert any("no room for a challenger" in m for m in msgs) and any("previous version kept" in m for m in msgs)


def test_drop_policy_is_what_a_processor_executes():
    [msg] = violations(variant(**{"topics/pm.raw.telemetry/data/drop_policy": "dlq"}))
    assert "drop_policy dlq" in msg and "backpressure" in msg
    limits = {"per_device": {"rate_per_s": 10, "burst": 10}}
    params = {**REFERENCE["processors"]["ingest"]["params"], "rate_limits": limits}
    [msg] = violations(variant(**{"processors/ingest/params": params}))
    assert "drop_policy never" in msg and "ingest" in msg
    assert violations(variant(**{"processors/ingest/params": params,
                                 "topics/pm.raw.telemetry/data/drop_policy": "dlq"})) == []


def test_co_partitioned_inputs_must_have_the_same_partition_count():
    msgs = violations(variant(**{"topics/pm.predictions.anomaly/partitions": 6}))
    assert len(msgs) == 2 and all("co-partitioned" in m and "has 6" in m for m in msgs)
    assert {m.split("'")[1] for m in msgs} == {"rules", "drift"}


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


def test_a_ttl_is_the_feature_sets_online_ttl():
    [msg] = violations(variant(**{"processors/features/state": {"ttl_s": 60}}))
    assert "ttl_s 60" in msg and "online.ttl_s is 3600" in msg
    [msg] = violations(variant(**{"processors/rules/state": {"hot_reload": True, "ttl_s": 60}}))
    assert "only a features processor writes" in msg
