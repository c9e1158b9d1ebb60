"""The reference application end to end: processors, the fleet simulator, live progress, a summary.

``run_demo`` starts every processor of the topology as its own process (as
containers would be), waits until each has joined its consumer group, runs the
fleet simulator in real time, watches the action and DLQ topics while it runs,
waits for the pipeline to drain, stops the processors and scores what happened
against the simulator's ground truth. Tests use the same code with a smaller fleet.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition
from rich.console import Console
from rich.table import Table

from streams import PROJECT_ROOT
from streams.avro import codec
from streams.errors import StackError
from streams.launcher import Processors, high_watermarks, wait_quiet
from streams.plan import apply
from streams.settings import StackSettings
from streams.simulator import Fleet
from streams.topology import Topology, load_schema, load_topology

DEFAULT_TOPOLOGY = PROJECT_ROOT / "topologies" / "predictive_maintenance.yaml"
LABELS_SUBJECT = "pm.sim.labels-value"
#: What each injected fault should lead to: an action type, or a DLQ reason at ingest.
EXPECTED = {
    "bearing_wear": ("action", "maintenance"),
    "overheating": ("action", "alert"),
    "sensor_dropout": ("action", "review"),
    "clock_skew": ("dlq", "future_timestamp"),
}


@dataclass
class Summary:
    """What a run did, scored against the ground truth."""

    duration_s: float
    readings_sent: int
    counts: dict[str, int]  # topic → records produced during the run
    dlq_reasons: dict[str, int]
    actions: list[dict]
    latencies_ms: list[float]
    faults: dict[str, dict]  # fault → {"devices", "detected", "missed", "delays_s"}
    false_alarms: list[dict]
    detections: dict[str, list[str]] = field(default_factory=dict)  # device → action types received

    @property
    def actions_by_type(self) -> dict[str, int]:
        return dict(Counter(a["action_type"] for a in self.actions))

    def latency_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


class Watcher(threading.Thread):
    """Reads the action and DLQ topics from given offsets while the run goes on."""

    def __init__(self, stack: StackSettings, topology: Topology, start: dict[TopicPartition, int], console: Console):
        super().__init__(daemon=True, name="demo-watcher")
        self.console = console
        self.topology = topology
        self.consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"tangram-demo-{os.getpid()}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed"})
        self.consumer.assign([TopicPartition(tp.topic, tp.partition, off) for tp, off in start.items()])
        self.codecs = {t: codec(stack.registry_url, s.schema_, load_schema(s.schema_))
                       for t, s in topology.topics.items() if ".actions." in t and s.schema_}
        self.actions: list[dict] = []
        self.latencies_ms: list[float] = []
        self.dlq: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for msg in self.consumer.consume(500, 0.2):
                if msg.error():
                    continue
                headers = {k: v.decode("utf-8", "replace") for k, v in (msg.headers() or [])}
                if msg.topic() in self.codecs:
                    action = self.codecs[msg.topic()].decode(msg.value())
                    self.actions.append(action)
                    latency = msg.timestamp()[1] - int(headers.get("ingest_ms", msg.timestamp()[1]))
                    self.latencies_ms.append(float(latency))
                    self.console.print(
                        f"  [bold magenta]{action['action_type']:<11}[/] {action['device_id']}  rule={action['rule']:<13} "
                        f"{action['label']} score={action['score']:.3f}  {latency} ms after the reading"
                    )
                else:
                    self.dlq.append({"topic": msg.topic(), "key": msg.key(), "reason": headers.get("dlq.reason", "?"),
                                     "message": headers.get("dlq.error_message", "")})

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.consumer.close()


def score(labels: list[dict], actions: list[dict], dlq: list[dict], since_ms: int = 0) -> tuple[dict, list[dict], dict]:
    """Detected / missed per injected fault, and the false alarms, against ground-truth ``FaultLabel`` records.

    Actions for windows that ended before ``since_ms`` are ignored (windows an earlier run left open).
    """
    by_device: dict[str, list[dict]] = defaultdict(list)
    for a in actions:
        if a["window_end"] > since_ms:
            by_device[a["device_id"]].append(a)
    dlq_by_device: dict[str, Counter] = defaultdict(Counter)
    for d in dlq:
        key = d["key"].decode("utf-8", "replace") if d["key"] else ""
        dlq_by_device[key][d["reason"]] += 1
    faults: dict[str, dict] = {}
    false_alarms: list[dict] = []
    for label in labels:
        device, fault = label["device_id"], label["fault"]
        onset_ms = label["onset_ts"] if fault != "none" else None
        expected = EXPECTED.get(fault)
        entry = faults.setdefault(fault, {"devices": 0, "detected": 0, "missed": 0, "delays_s": []})
        entry["devices"] += 1
        hit = None
        for a in sorted(by_device[device], key=lambda a: a["window_end"]):
            if expected and expected[0] == "action" and a["action_type"] == expected[1] and a["window_end"] >= onset_ms:
                hit = hit or a
            else:
                false_alarms.append(a)
        detected = dlq_by_device[device][expected[1]] > 0 if expected and expected[0] == "dlq" else hit is not None
        if expected:
            entry["detected" if detected else "missed"] += 1
            if hit is not None:
                entry["delays_s"].append((hit["window_end"] - onset_ms) / 1000)
    detections = {d: sorted({a["action_type"] for a in acts}) for d, acts in by_device.items() if acts}
    return faults, false_alarms, detections


def run_pipeline(stack: StackSettings, fleet: Fleet, duration_s: float, *, topology_path: Path = DEFAULT_TOPOLOGY,
                 console: Console | None = None) -> Summary:
    """Run the topology's processors and the simulator for ``duration_s``; return the scored summary."""
    console = console or Console()
    topology = load_topology(topology_path)
    stack.logs_dir.mkdir(parents=True, exist_ok=True)
    apply(topology, stack)
    probe = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": "tangram-demo-probe"})
    processors = Processors(topology_path, stack)
    watcher = None
    try:
        console.print(f"starting processors: {', '.join(topology.processors)} (logs in {stack.logs_dir})")
        processors.start()
        processors.wait_joined(timeout_s=90)
        before = high_watermarks(probe, topology)
        watched = [t for t in topology.topics if ".actions." in t or ".dlq." in t]
        watcher = Watcher(stack, topology, {tp: off for tp, off in before.items() if tp.topic in watched}, console)
        watcher.start()

        producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True,
                             "acks": "all", "linger.ms": 5, "compression.type": "lz4"})
        start_ms = int(time.time() * 1000)
        labels_topic = next(t for t, spec in topology.topics.items() if spec.schema_ == LABELS_SUBJECT)
        raw_topic = topology.processors["ingest"].inputs[0]
        labels = codec(stack.registry_url, LABELS_SUBJECT, load_schema(LABELS_SUBJECT))
        for label in fleet.labels(start_ms):
            producer.produce(labels_topic, labels.encode(label), label["device_id"])
        console.print(f"simulating {len(fleet.devices)} devices at {fleet.hz:g} Hz for {duration_s:g}s "
                      f"(faults: {', '.join(sorted({d.fault for d in fleet.devices} - {'none'}))})")
        sent, t0, last_report = 0, time.monotonic(), time.monotonic()
        send = lambda key, value: producer.produce(raw_topic, value, key)  # noqa: E731
        for n in fleet.run(send, duration_s, start_ms):
            sent += n
            producer.poll(0)
            if time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                elapsed = last_report - t0
                console.print(f"[dim]t={elapsed:4.0f}s  sent {sent} readings ({sent / elapsed:,.0f}/s)  "
                              f"actions {len(watcher.actions)}  dead letters {len(watcher.dlq)}[/]")
        if producer.flush(30):
            raise StackError("simulator readings were not all acknowledged by Kafka")
        console.print("simulator done; waiting for the pipeline to drain")
        wait_quiet(probe, topology)
        after = high_watermarks(probe, topology)
        watcher.stop()
        counts: Counter = Counter()
        for tp, high in after.items():
            counts[tp.topic] += high - before[tp]
        faults, false_alarms, detections = score(fleet.labels(start_ms), watcher.actions, watcher.dlq, since_ms=start_ms)
        return Summary(
            duration_s=time.monotonic() - t0,
            readings_sent=sent,
            counts=dict(counts),
            dlq_reasons=dict(Counter(f"{d['topic']}:{d['reason']}" for d in watcher.dlq)),
            actions=watcher.actions,
            latencies_ms=watcher.latencies_ms,
            faults=faults,
            false_alarms=false_alarms,
            detections=detections,
        )
    finally:
        if watcher is not None and watcher.is_alive():
            watcher.stop()
        processors.stop()
        probe.close()


def print_summary(summary: Summary, console: Console) -> None:
    flow = Table(title="pipeline", show_header=True)
    flow.add_column("stage")
    flow.add_column("records", justify="right")
    flow.add_row("readings sent (JSON)", f"{summary.readings_sent:,}")
    for stage in (".ingest.", ".features.", ".predictions."):
        for topic, n in sorted(summary.counts.items()):
            if stage in topic:
                flow.add_row(topic, f"{n:,}")
    for reason, n in sorted(summary.dlq_reasons.items()):
        flow.add_row(f"DLQ {reason}", f"{n:,}")
    for kind, n in sorted(summary.actions_by_type.items()):
        flow.add_row(f"actions: {kind}", f"{n:,}")
    console.print(flow)

    faults = Table(title="injected faults vs ground truth")
    for col in ("fault", "devices", "detected", "missed", "median delay after onset"):
        faults.add_column(col, justify="right" if col != "fault" else "left")
    for fault, e in sorted(summary.faults.items()):
        if fault == "none" or fault == "malformed":
            continue
        delay = f"{np.median(e['delays_s']):.1f}s" if e["delays_s"] else "-"
        faults.add_row(fault, str(e["devices"]), str(e["detected"]), str(e["missed"]), delay)
    console.print(faults)
    healthy = summary.faults.get("none", {}).get("devices", 0)
    console.print(f"false alarms: {len(summary.false_alarms)} (actions on the {healthy} healthy devices, or not matching "
                  "a device's fault, or before its onset)")
    for a in summary.false_alarms:
        console.print(f"  {a['action_type']} {a['device_id']} rule={a['rule']} window_end={a['window_end']}")
    console.print(f"event-to-action latency: p50 {summary.latency_ms(50):.0f} ms, p99 {summary.latency_ms(99):.0f} ms "
                  f"over {len(summary.latencies_ms)} actions (reading produced → action produced)")


def run_demo(stack: StackSettings, duration_s: float, n_devices: int, seed: int) -> Summary:
    console = Console()
    fleet = Fleet.demo(n_devices=n_devices, seed=seed)
    summary = run_pipeline(stack, fleet, duration_s, console=console)
    print_summary(summary, console)
    (stack.home / "last_demo.json").write_text(json.dumps({
        "readings_sent": summary.readings_sent, "counts": summary.counts, "dlq": summary.dlq_reasons,
        "actions": summary.actions_by_type, "faults": {k: {**v, "delays_s": v["delays_s"]} for k, v in summary.faults.items()},
        "false_alarms": len(summary.false_alarms),
        "latency_ms": {"p50": summary.latency_ms(50), "p99": summary.latency_ms(99)},
    }, indent=2))
    return summary
