"""The walking skeleton end to end on the real stack: simulator → ingest → features → Triton → rules → actions.

It runs twice: on the developer stack, and on the secured stack (every processor its own SASL_SSL
principal with the ACLs `tangram apply` generated, the registry's read-only user, its own Redis
user, Triton's model control behind a key).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from rich.console import Console

from streams.avro import codec
from streams.topology import load_topology
from reference import load_schema
from streams.trace import trace

from streams.demo import run_pipeline
from pm_app.simulator import Device, Fleet, FleetSettings, FleetSimulator

from isolation import isolated_topology

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["stack", "secured_stack"])
def run_on(request):
    """The stack a run uses: the developer stack, then the secured one."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def pipeline(run_on, tmp_path_factory):
    """One short run of the reference topology: a worn bearing, two healthy machines, one sending garbage."""
    stack = run_on
    rng = np.random.default_rng(11)
    devices = [
        Device.random("bearing-1", rng, "bearing_wear", onset_s=3.0),
        Device.random("healthy-1", rng),
        Device.random("healthy-2", rng),
        Device.random("garbage-1", rng, "malformed", onset_s=0.0),
    ]
    topology, _ = isolated_topology(tmp_path_factory.mktemp("pipeline"))
    simulator = FleetSimulator(load_topology(topology), FleetSettings(), entities=len(devices), seed=5,
                               fleet=Fleet(devices, hz=10.0, seed=5))
    summary = run_pipeline(stack, topology, simulator, 35.0, console=Console(force_terminal=False))
    return summary, topology


def detections(summary) -> dict[str, list[str]]:
    """Device → the action types it got."""
    out: dict[str, list[str]] = {}
    for a in summary.actions:
        out.setdefault(a["device_id"], []).append(a["action_type"])
    return out


@pytest.fixture(scope="module")
def summary(pipeline):
    return pipeline[0]


def test_bearing_fault_gets_a_maintenance_action(summary):
    assert "maintenance" in detections(summary).get("bearing-1", []), detections(summary)
    assert summary.scoreboard.figures["faults"]["bearing_wear"]["detected"] == 1
    action = next(a for a in summary.actions if a["device_id"] == "bearing-1")
    assert action["rule"] == "bearing_wear" and action["label"] == "bearing_wear"
    assert action["model_name"] == "anomaly" and action["model_version"] == "1"
    assert "confidence" in action["inputs"] and action["reason"].startswith("label == 'bearing_wear'")


def test_healthy_devices_get_no_action(summary):
    for device in ("healthy-1", "healthy-2"):
        assert device not in detections(summary), detections(summary)
    assert summary.scoreboard.figures["false alarms"] == 0


def test_malformed_records_land_in_the_dlq_and_the_device_keeps_flowing(summary):
    reasons = {r.split(":", 1)[1] for r in summary.dlq_reasons if ".dlq.ingest:" in r}
    assert reasons and reasons <= {"bad_json", "schema", "out_of_range", "not_utf8"}, summary.dlq_reasons
    dlq = sum(n for r, n in summary.dlq_reasons.items() if ".dlq.ingest:" in r)
    ingested = next(n for t, n in summary.counts.items() if t.endswith(".ingest.telemetry"))
    # every reading is either ingested or dead-lettered: none is lost
    assert summary.events_sent > 1000 and ingested + dlq == summary.events_sent
    # the garbage device's good readings still make windows (its partition never stalled)
    windows = next(n for t, n in summary.counts.items() if t.endswith(".features.device_window"))
    assert windows >= 4 * math.floor(30 / 5) - 4


def test_the_scoreboard_shows_the_served_models_accuracy_with_and_without_the_register_attributes(run_on, summary):
    card = json.loads((run_on.model_repository / "anomaly" / "model_card.json").read_text())
    assert summary.scoreboard.figures["anomaly held-out accuracy with / without attributes / with defaults"] == \
        " / ".join(f"{card[k]['accuracy']:.4f}" for k in ("metrics", "metrics_without_attributes", "metrics_with_defaults"))
    assert any(n.startswith("model anomaly v1") and "rated_temperature" in n for n in summary.scoreboard.notes)


def test_event_to_action_latency_is_measured(summary):
    assert summary.latencies_ms and all(0 <= ms < 30_000 for ms in summary.latencies_ms)


def test_a_trace_covers_every_hop_of_a_real_event(run_on, pipeline):
    stack, (summary, path) = run_on, pipeline
    topology = load_topology(path)
    action = next(a for a in summary.actions if a["device_id"] == "bearing-1")
    ingest = topology.processors["ingest"].outputs[0]
    consumer = Consumer(stack.kafka.config({"group.id": f"t-{uuid.uuid4().hex}", "enable.auto.commit": False}))
    consumer.assign([TopicPartition(ingest, p, 0) for p in range(topology.partitions(ingest))])
    reading_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    event_id, deadline = None, time.monotonic() + 30
    while event_id is None and time.monotonic() < deadline:
        for msg in consumer.consume(1000, 0.5):
            if not msg.error() and msg.key() == b"bearing-1":
                reading = reading_codec.decode(msg.value())
                if action["window_end"] - 5000 <= reading["ts"] < action["window_end"]:
                    event_id = reading["event_id"]
                    break
    consumer.close()
    assert event_id, "no reading inside the action's window"
    hops = trace(stack, topology, event_id)
    assert [h.stage for h in hops][:2] == ["producer", "ingest"]
    assert {"features", "inference", "rules"} <= {h.stage for h in hops}, hops
    assert [h.timestamp_ms for h in hops] == sorted(h.timestamp_ms for h in hops)
    for hop in hops[1:]:
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", hop.trace), hop
    assert any(h.detail.startswith("maintenance by rule bearing_wear") for h in hops)
