"""Replay and backtests on the real stack: range selection, isolation of live groups, determinism, cleanup."""

from __future__ import annotations

import shutil
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console

from streams.launcher import high_watermarks
from streams.plan import apply
from streams.replay import agreement, backtest, delete_run, list_runs, replay, simulate_history
from pm_app.simulator import Device, Fleet, FleetSettings, FleetSimulator
from streams.topology import load_topology

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def _records(stack, topic: str, partitions: int) -> list:
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"r-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out, idle = [], 0
    while idle < 4:
        batch = [m for m in consumer.consume(2000, 0.5) if not m.error()]
        out.extend(batch)
        idle = 0 if batch else idle + 1
    consumer.close()
    return out


def recall(result) -> float:
    """Detected over injected, of the faults the rules act on (the simulator's precision / recall / F1 figure)."""
    return float(result.figures["precision / recall / F1"].split(" / ")[1])


@pytest.fixture(scope="module")
def live(stack, tmp_path_factory):
    """A 'live' topology with 90 s of history from six machines, and a live group with committed offsets."""
    path, prefix = isolated_topology(tmp_path_factory.mktemp("live"), own_state=True)
    topology = load_topology(path)
    apply(topology, stack)
    rng = np.random.default_rng(3)
    devices = [Device.random("bearing-1", rng, "bearing_wear", onset_s=20.0), Device.random("hot-1", rng, "overheating", 15.0)]
    devices += [Device.random(f"ok-{i}", rng) for i in range(4)]
    simulator = FleetSimulator(topology, FleetSettings(), entities=len(devices), seed=9,
                               fleet=Fleet(devices, hz=10.0, seed=9))
    sent, start_ms = simulate_history(stack, simulator, 90.0)
    raw = topology.processors["ingest"].inputs[0]
    # a live consumer group that has read half of the raw topic
    group = topology.group("ingest")
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": group, "enable.auto.commit": False})
    ends = high_watermarks(consumer, topology, [raw])
    consumer.commit(offsets=[TopicPartition(tp.topic, tp.partition, end // 2) for tp, end in ends.items()], asynchronous=False)
    consumer.close()
    return {"path": path, "topology": topology, "raw": raw, "sent": sent, "start_ms": start_ms, "group": group}


def test_range_by_offsets_copies_records_exactly(stack, live):
    run = replay(stack, live["path"], start_offset=10, end_offset=110, run_id=f"o{uuid.uuid4().hex[:6]}")
    try:
        assert run.records == sum(hi - lo for lo, hi in run.ranges.values()) == 300
        source = {(m.partition(), m.offset()): m for m in _records(stack, live["raw"], 3)}
        copied = _records(stack, f"{run.prefix}.raw.telemetry", 3)
        assert len(copied) == 300
        for m in copied:
            original = source[(m.partition(), 10 + m.offset())]
            assert (m.key(), m.value(), m.headers(), m.timestamp()) == (
                original.key(), original.value(), original.headers(), original.timestamp())
    finally:
        delete_run(stack, run.run_id)


def test_range_by_time_selects_by_timestamp(stack, live):
    since, until = live["start_ms"] + 30_000, live["start_ms"] + 40_000
    run = replay(stack, live["path"], start_ms=since, end_ms=until, run_id=f"t{uuid.uuid4().hex[:6]}")
    try:
        copied = _records(stack, f"{run.prefix}.raw.telemetry", 3)
        assert copied and all(since <= m.timestamp()[1] < until for m in copied)
        assert len(copied) == run.records == 600  # 10 s × 10 Hz × 6 devices
    finally:
        delete_run(stack, run.run_id)


def test_backtest_is_isolated_deterministic_and_cleaned_up(stack, live):
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    probe = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": live["group"], "enable.auto.commit": False})
    tps = [TopicPartition(live["raw"], p) for p in range(3)]
    committed_before = [(tp.partition, tp.offset) for tp in probe.committed(tps, timeout=10)]
    live_topics = [t for t in live["topology"].topics]
    ends_before = high_watermarks(probe, live["topology"], live_topics)
    groups_before = {g.group_id for g in admin.list_consumer_groups().result(timeout=10).valid}

    run = replay(stack, live["path"], run_id=f"b{uuid.uuid4().hex[:6]}")
    assert run.records == live["sent"]
    assert run.run_id in {r.run_id for r in list_runs(stack)}
    console = Console(width=160, force_terminal=False)
    first, second = backtest(stack, run.run_id, ["1", "1"], console=console)

    # the same range through the same version twice: byte-identical actions
    assert first.digest == second.digest
    assert first.actions == second.actions and sum(first.actions.values()) > 0
    assert first.figures["faults"]["bearing_wear"]["detected"] == 1
    assert first.figures["faults"]["overheating"]["detected"] == 1
    assert recall(first) == 1.0
    report_dir = stack.home / "replays" / run.run_id
    assert (report_dir / "report.json").exists() and (report_dir / "report.png").read_bytes()[:4] == b"\x89PNG"

    # the live side never moved: same committed offsets, same topic ends, no live group created
    assert [(tp.partition, tp.offset) for tp in probe.committed(tps, timeout=10)] == committed_before
    assert high_watermarks(probe, live["topology"], live_topics) == ends_before
    probe.close()
    new_groups = {g.group_id for g in admin.list_consumer_groups().result(timeout=10).valid} - groups_before
    assert new_groups and all(g.startswith(run.prefix + "_") for g in new_groups), new_groups

    topics, groups = delete_run(stack, run.run_id)
    assert topics and groups
    remaining = [t for t in admin.list_topics(timeout=10).topics if t.startswith(run.prefix)]
    assert remaining == []
    assert run.run_id not in {r.run_id for r in list_runs(stack)}


def test_backtest_of_two_versions_reports_the_difference_built_into_them(stack, live, tmp_path):
    """Version 1 against version 2, a model trained blind to overheating: the report shows it."""
    from pm_app.train import train
    from triton_helpers import REPOSITORY, TritonProcess, own_triton

    repo = tmp_path / "repo"
    (repo / "anomaly" / "1").mkdir(parents=True)
    shutil.copy(REPOSITORY / "anomaly" / "config.pbtxt", repo / "anomaly" / "config.pbtxt")
    shutil.copy(REPOSITORY / "anomaly" / "labels.txt", repo / "anomaly" / "labels.txt")
    shutil.copy(REPOSITORY / "anomaly" / "1" / "model.onnx", repo / "anomaly" / "1" / "model.onnx")
    scratch = tmp_path / "blind"
    train(scratch, seed=5, blind_to=("overheating",), version=2)
    (repo / "anomaly" / "2").mkdir()
    shutil.copy(scratch / "anomaly" / "2" / "model.onnx", repo / "anomaly" / "2" / "model.onnx")
    triton = TritonProcess(repo, tmp_path / "triton.log")
    triton.start()
    try:
        own = own_triton(stack)
        run = replay(own, live["path"], run_id=f"v{uuid.uuid4().hex[:6]}")
        try:
            v1, blind = backtest(own, run.run_id, ["1", "2"], console=Console(width=160, force_terminal=False))
        finally:
            delete_run(own, run.run_id)
    finally:
        triton.stop()
    faults = v1.figures["faults"], blind.figures["faults"]
    assert faults[0]["overheating"]["detected"] == 1 and faults[1]["overheating"]["detected"] == 0
    assert v1.labels.get("overheating", 0) > 0 and blind.labels.get("overheating", 0) == 0
    assert faults[0]["bearing_wear"]["detected"] == faults[1]["bearing_wear"]["detected"] == 1
    assert recall(blind) < recall(v1) == 1.0
    assert v1.digest != blind.digest
    assert agreement(v1, blind) < 1.0
