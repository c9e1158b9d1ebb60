"""``tangram plan --capacity``: rates carried down the topology, replicas at the target utilization, the
refusal when partitions are too few, per-replica costs read from a ``make bench`` results file."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from reference import REPO as PROJECT_ROOT
from streams.capacity import load_bench, needed, parse_rate, plan_capacity
from streams.cli import app
from streams.diagram import to_dot, to_mermaid
from streams.topology import Kind, Topology

APPS = [PROJECT_ROOT / "topologies" / "predictive_maintenance", PROJECT_ROOT / "topologies" / "document_intake"]


def _topology(partitions: int = 4, **ingest) -> dict:
    """A source of 1k/s baseline, 10k/s peak → ingest → rules, declared in code (json topics: no schemas)."""
    return {
        "app": "t",
        "defaults": {"partitions": partitions},
        "topics": {
            "t.raw": {"format": "json", "data": {"baseline_rate": 1000, "peak_rate": 10000}},
            "t.clean": {"format": "json"},
            "t.actions": {"format": "json"},
        },
        "processors": {
            "ingest": {"kind": Kind.INGEST, "inputs": ["t.raw"], "outputs": ["t.clean"],
                       "compute": {"max_rate_per_replica": 5000, "target_utilization": 0.5, **ingest}},
            "rules": {"kind": Kind.RULES, "inputs": ["t.clean"], "outputs": ["t.actions"],
                      "compute": {"max_rate_per_replica": 20000, "target_utilization": 0.5}},
        },
    }


def _results(path, figures: list[dict]) -> None:
    base = {"measured": "", "baseline": "", "ratio": "", "n": 1000, "batch": 500, "benchmark": "b", "value": None,
            "commit": "abc1234", "at": "", "load": ""}
    path.write_text(json.dumps({"machine": "test machine", "figures": [{**base, **f} for f in figures]}))


def test_parse_rate_reads_the_figure_text():
    assert parse_rate("35,981 records/s") == (35981.0, "records")
    assert parse_rate("67,705 readings/s, 9.7 µs CPU/reading") == (67705.0, "readings")
    assert parse_rate("42.3 ms (2,362 feature windows/s at step 100)") == (2362.0, "feature windows")
    assert parse_rate("p99 295.3 ms") is None


def test_replicas_at_the_target_utilization():
    assert needed(10000, 5000, 0.5) == 4  # exactly four, not five
    assert needed(10001, 5000, 0.5) == 5
    assert needed(1, 5000, 0.7) == 1
    assert needed(None, 5000, 0.7) is None and needed(100, None, 0.7) is None


def test_the_math_on_a_small_topology():
    plan = plan_capacity(Topology(**_topology()))
    assert plan.topics["t.raw"].peak == 10000 and plan.topics["t.raw"].source == "declared (data:)"
    assert plan.topics["t.clean"].peak == 10000 and plan.topics["t.clean"].baseline == 1000  # one out per one in
    ingest, rules = plan.stages
    assert ingest.capacity.per_replica == 5000 and "declared" in ingest.capacity.source
    assert ingest.replicas_needed == 4 and ingest.partitions_needed == 4 and ingest.partitions == 4
    assert rules.replicas_needed == 1  # 10k / (20k × 0.5)
    assert plan.refusals() == []


def test_refused_when_the_partitions_cannot_carry_the_peak(tmp_path):
    plan = plan_capacity(Topology(**_topology(partitions=3)))
    [refusal] = plan.refusals()
    assert "'ingest' needs 4 replicas" in refusal and "'t.raw' has 3 partitions" in refusal
    assert "partitions: 4" in refusal
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "topology.yaml").write_text(yaml.safe_dump(_topology(partitions=3)))
    result = CliRunner().invoke(app, ["plan", str(folder), "--capacity", "--bench", str(tmp_path / "none.json")])
    assert result.exit_code == 1, result.output
    assert "refused" in result.output and "needs 4 replicas" in result.output


def test_unknown_capacity_is_said_not_guessed():
    spec = _topology()
    del spec["processors"]["rules"]["compute"]["max_rate_per_replica"]
    plan = plan_capacity(Topology(**spec))
    rules = plan.stages[1]
    assert rules.replicas_needed is None and rules.capacity.source.startswith("unknown")
    assert plan.refusals() == []


def test_costs_read_from_a_results_file(tmp_path):
    results = tmp_path / "results.json"
    _results(results, [
        {"path": "ingest validation, Kafka → Kafka (JSON → Avro, at-least-once)", "measured": "1,000 records/s"},
        {"path": "ingest validation, Kafka → Kafka (JSON → Avro, at-least-once)", "measured": "2,500 records/s",
         "commit": "def5678"},  # a later run of the same figure wins
        {"path": "rule processor (predictions → actions)", "measured": "3,017 events/s", "value": 4000.0},
        {"path": "drift: false alarms", "measured": "0 sustained alerts in 104 evaluations"},  # no rate: skipped
    ])
    bench = load_bench(results)
    assert bench.machine == "test machine" and len(bench.figures) == 3
    plan = plan_capacity(Topology(**_topology(partitions=8)), bench)
    ingest, rules = plan.stages
    assert ingest.capacity.per_replica == 2500 and ingest.capacity.figure.commit == "def5678"
    assert "bench def5678" in ingest.capacity.source  # the figure beats the declaration
    assert ingest.replicas_needed == 8  # 10k / (2.5k × 0.5)
    assert rules.capacity.per_replica == 4000  # the figure's value, when it carries one
    assert plan.refusals() == []
    assert load_bench(tmp_path / "missing.json").figures == ()


def test_flink_slots_and_triton_servers_from_the_bench(tmp_path):
    results = tmp_path / "results.json"
    _results(results, [
        {"path": "feature windows: embedded engine (delivery loop)", "measured": "40,000 readings/s"},
        {"path": "feature windows: Flink SQL job, parallelism 1 (mini-cluster)", "measured": "20,000 readings/s"},
        {"path": "inference worker, batch 256 (pipelined, at-least-once)", "measured": "50,000 rows/s", "batch": 256,
         "baseline": "direct tritonclient on the same batches 400,000 rows/s; raw Kafka loop 129,047"},
    ])
    plan = plan_capacity(Topology.model_validate({**yaml.safe_load((APPS[0] / "topology.yaml").read_text()),
                                                  "root": str(APPS[0])}), load_bench(results))
    stages = {s.name: s for s in plan.stages}
    features, inference = stages["features"], stages["inference"]
    assert features.rate.sizing == 2000  # the declared peak of pm.raw.telemetry, carried through ingest
    assert features.flink_parallelism == 1 and "Flink SQL job" in features.flink_source
    assert plan.topics["pm.features.device_window"].peak == pytest.approx(40)  # one window per 50 readings
    assert inference.capacity.per_replica == 50000 and inference.triton_servers == 1
    assert "400,000 rows/s" in inference.triton_source


@pytest.mark.parametrize("folder", APPS, ids=lambda p: p.name)
def test_both_reference_apps_plan_their_capacity(folder, tmp_path):
    results = tmp_path / "results.json"
    _results(results, [{"path": "ingest validation, Kafka → Kafka", "measured": "64,619 records/s"}])
    result = CliRunner().invoke(app, ["plan", str(folder), "--capacity", "--bench", str(results)])
    assert result.exit_code == 0, result.output
    assert "capacity at the declared peak" in result.output
    assert "every stage's peak fits" in result.output


def test_the_diagram_draws_the_figures_the_plan_prints(tmp_path):
    """`tangram diagram --capacity` writes on each stage what `tangram plan --capacity` prints for it."""
    results = tmp_path / "results.json"
    _results(results, [{"path": "ingest validation, Kafka → Kafka", "measured": "1,000 records/s"}])
    topology = Topology(**_topology(partitions=8))
    plan = plan_capacity(topology, load_bench(results))
    ingest = next(s for s in plan.stages if s.name == "ingest")
    assert ingest.replicas_needed == 20 and not ingest.fits  # 10k/s at 1k/s a replica, utilization 0.5: 20 > 8
    dot, mermaid = to_dot(topology, plan), to_mermaid(topology, plan)
    for text in (dot, mermaid):
        assert "peak 10,000/s, a replica 1,000/s at util 0.5" in text
        assert "replicas 20 (declared 1), partitions 20 (have 8): TOO FEW" in text
    printed = CliRunner().invoke(app, ["plan", "--capacity", "--bench", str(results), str(_write(tmp_path, topology))])
    assert printed.exit_code == 1 and "20 (8)" in printed.output  # the same figures, refused
    assert "a replica" not in to_dot(topology)  # without --capacity: the declarations only
    drawn = CliRunner().invoke(app, ["diagram", str(_write(tmp_path, topology)), "--capacity", "--bench", str(results),
                                     "--formats", "dot", "--out", str(tmp_path / "d")])
    assert drawn.exit_code == 0, drawn.output
    assert "replicas 20 (declared 1)" in (tmp_path / "d.dot").read_text()


def _write(tmp_path, topology: Topology):
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topology.model_dump(mode="json", by_alias=True, exclude_none=True)))
    return path
