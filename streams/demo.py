"""``tangram demo APP``: an app end to end on the local stack, driven by its simulator, scored by it.

``run_pipeline`` starts every processor of the topology as its own process (as containers
would be), waits until each has joined its consumer group, produces the app's simulated events
in real time, watches the action and DLQ topics while it runs (each action printed as it
happens, with its latency), waits for the pipeline to drain, stops the processors and asks the
app's simulator to score what happened against its ground truth. Tests use the same code with a
smaller simulation.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from streams.avro import topic_codec
from streams.features.enrich import FILTERED_METRIC
from streams.launcher import Processors, high_watermarks, wait_quiet
from streams.lifecycle.drill import LifecycleDrill
from streams.lifecycle.repository import CARD_FILE, model_dirs
from streams.plan import apply
from streams.rules.spec import RulesSettings
from streams.settings import StackSettings
from streams.simulation import (
    DeadLetter, Observed, Scoreboard, Simulator, build_simulator, flush, producer, run_ticks, send_run_context,
)
from streams.topology import Kind, Topology, load_topology

log = logging.getLogger("tangram.demo")


@dataclass
class Summary:
    """What a run did, and the app's verdict on it."""

    duration_s: float
    events_sent: int
    counts: dict[str, int]  # topic → records produced during the run
    dlq_reasons: dict[str, int]  # "<dlq topic>:<reason>" → records
    filtered: dict[str, int]  # "<attribute>=<value>" → records a feature stage's `keep` filtered out
    actions: list[dict]
    latencies_ms: list[float]  # event entering Kafka → action produced, for actions derived from an event
    scoreboard: Scoreboard = field(default_factory=Scoreboard)
    drill: list[str] = field(default_factory=list)  # what the lifecycle drill measured, one line per step

    @property
    def actions_by_type(self) -> dict[str, int]:
        return dict(Counter(a["action_type"] for a in self.actions))

    def latency_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


def action_topics(topology: Topology) -> dict[str, str]:
    """Every topic a rule processor writes actions to → the entity field of its actions."""
    out = {}
    for spec in topology.processors_of(Kind.RULES).values():
        entity = RulesSettings.model_validate(spec.params).entity_field
        out.update({topic: entity for topic in spec.outputs})
    return out


def dlq_topics(topology: Topology) -> list[str]:
    return list(dict.fromkeys(spec.dlq for spec in topology.processors.values() if spec.dlq))


class Watcher(threading.Thread):
    """Reads the action and DLQ topics from given offsets while the run goes on."""

    def __init__(self, stack: StackSettings, topology: Topology, start: dict[TopicPartition, int], console: Console):
        super().__init__(daemon=True, name="demo-watcher")
        self.console = console
        self.consumer = Consumer(stack.kafka.config({"group.id": f"tangram-demo-{os.getpid()}",
                                                     "enable.auto.commit": False, "isolation.level": "read_committed"}))
        self.consumer.assign([TopicPartition(tp.topic, tp.partition, off) for tp, off in start.items()])
        self.entity = action_topics(topology)
        self.codecs = {t: topic_codec(topology, stack.registry_url, t) for t in self.entity}
        self.actions: list[dict] = []
        self.latencies_ms: list[float] = []
        self.dead_letters: list[DeadLetter] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for msg in self.consumer.consume(500, 0.2):
                if msg.error():
                    continue
                headers = {k: v.decode("utf-8", "replace") for k, v in (msg.headers() or [])}
                if msg.topic() in self.codecs:
                    self._action(msg, headers)
                else:
                    key = msg.key().decode("utf-8", "replace") if msg.key() else ""
                    self.dead_letters.append(DeadLetter(msg.topic(), key, headers.get("dlq.reason", "?"),
                                                        headers.get("dlq.error_message", "")))

    def _action(self, msg, headers: dict[str, str]) -> None:
        action = {**self.codecs[msg.topic()].decode(msg.value()), "_topic": msg.topic()}
        self.actions.append(action)
        entity = action.get(self.entity[msg.topic()], "")
        if "ingest_ms" in headers:  # decided on an event: its latency from the event entering Kafka
            latency = msg.timestamp()[1] - int(headers["ingest_ms"])
            self.latencies_ms.append(float(latency))
            after = f"{latency} ms after the event"
        else:  # a decision of the pipeline about itself (a drift alert): no event to time it from
            after = "(no source event)"
        self.console.print(f"  [bold magenta]{action['action_type']:<11}[/] {entity}  rule={action['rule']:<13} "
                           f"{action.get('label', '')} score={action.get('score', 0.0):.3f}  {after}")

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.consumer.close()


def run_pipeline(stack: StackSettings, topology_path: Path, simulator: Simulator, duration_s: float, *,
                 console: Console | None = None, drill: bool = False) -> Summary:
    """Run the app's processors and its simulator for ``duration_s``; return the scored summary.

    ``drill``: the lifecycle drill (:mod:`streams.lifecycle.drill`) promotes and rolls back a model
    version while the run goes on, each change timed to the first prediction it makes."""
    console = console or Console()
    topology = load_topology(topology_path)
    stack.logs_dir.mkdir(parents=True, exist_ok=True)
    apply(topology, stack)
    lifecycle = LifecycleDrill(topology, stack, console) if drill else None
    if lifecycle is not None:
        lifecycle.prepare()
    probe = Consumer(stack.kafka.config({"group.id": "tangram-demo-probe"}))
    processors = Processors(topology_path, stack)
    watcher = None
    try:
        console.print(f"starting processors: {', '.join(topology.processors)} (logs in {stack.logs_dir})")
        processors.start()
        processors.wait_joined(timeout_s=90)
        before = high_watermarks(probe, topology)
        watched = {*action_topics(topology), *dlq_topics(topology)}
        watcher = Watcher(stack, topology, {tp: off for tp, off in before.items() if tp.topic in watched}, console)
        watcher.start()
        if lifecycle is not None:
            lifecycle.start()
        out = producer(stack)
        start_ms = int(time.time() * 1000)
        send_run_context(stack, simulator, start_ms, out)
        console.print(f"simulating {simulator.describe()} for {duration_s:g}s")
        sent, t0, last_report = 0, time.monotonic(), time.monotonic()
        for events in run_ticks(simulator, out, duration_s, start_ms):
            sent += len(events)
            if lifecycle is not None and lifecycle.active:
                lifecycle.tick((time.monotonic() - t0) / duration_s)
            if time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                elapsed = last_report - t0
                rate = sent / elapsed
                console.print(f"[dim]t={elapsed:4.0f}s  sent {sent} events ({rate:,.{1 if rate < 10 else 0}f}/s)  "
                              f"actions {len(watcher.actions)}  dead letters {len(watcher.dead_letters)}[/]")
        flush(out, 30)
        console.print("simulator done; waiting for the pipeline to drain")
        wait_quiet(probe, topology, timeout_s=max(60.0, duration_s * 5))
        after = high_watermarks(probe, topology)
        filtered = filtered_counts(processors.endpoints())
        watcher.stop()
        counts: Counter = Counter()
        for tp, high in after.items():
            counts[tp.topic] += high - before[tp]
        observed = Observed(start_ms=start_ms, truth=[record for _, record in simulator.truth(start_ms)],
                            actions=watcher.actions, dead_letters=watcher.dead_letters, filtered=filtered,
                            model_cards=served_cards(topology, stack))
        return Summary(
            duration_s=time.monotonic() - t0,
            events_sent=sent,
            counts=dict(counts),
            dlq_reasons=dict(Counter(f"{d.topic}:{d.reason}" for d in watcher.dead_letters)),
            filtered=filtered,
            actions=watcher.actions,
            latencies_ms=watcher.latencies_ms,
            scoreboard=simulator.score(observed),
            drill=lifecycle.summary() if lifecycle is not None else [],
        )
    finally:
        if lifecycle is not None:
            lifecycle.stop()
        if watcher is not None and watcher.is_alive():
            watcher.stop()
        processors.stop()
        probe.close()


def served_cards(topology: Topology, stack: StackSettings) -> dict[str, dict]:
    """The model cards of the app's models in the stack's model repository (what `apply` installed), model → card;
    a model without a readable card is left out, with a warning."""
    out = {}
    for folder in model_dirs(topology.model_repository):
        card = stack.model_repository / folder.name / CARD_FILE
        try:
            out[folder.name] = json.loads(card.read_text())
        except (OSError, ValueError) as exc:
            log.warning("model card of %s not readable: %s", folder.name, exc)
    return out


def filtered_counts(endpoints: list[dict]) -> dict[str, int]:
    """The records the processors' declared filters took out of the stream (``tangram_features_filtered_total``,
    summed over replicas), "<attribute>=<value>" → count, read from their metrics endpoints."""
    out: Counter = Counter()
    for endpoint in endpoints:
        if not endpoint.get("metrics_url"):
            continue
        try:
            with urllib.request.urlopen(endpoint["metrics_url"], timeout=5) as response:
                text = response.read().decode()
        except OSError as exc:  # a replica that died: its count is gone with it, the others still count
            log.warning("metrics of %s not readable: %s", endpoint.get("name"), exc)
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == FILTERED_METRIC:
                    out[f"{sample.labels['attribute']}={sample.labels['value']}"] += int(sample.value)
    return dict(out)


def print_summary(topology: Topology, summary: Summary, console: Console) -> None:
    flow = Table(title="pipeline", show_header=True)
    flow.add_column("stage")
    flow.add_column("records", justify="right")
    source = topology.simulator.source if topology.simulator else "source"
    flow.add_row(f"events sent ({source})", f"{summary.events_sent:,}")
    skipped = {source, *action_topics(topology), *dlq_topics(topology)}
    for topic in topology.topics:  # declaration order: the stages in the order the app declares them
        if topic not in skipped and summary.counts.get(topic):
            flow.add_row(topic, f"{summary.counts[topic]:,}")
    for why, n in sorted(summary.filtered.items()):
        flow.add_row(f"filtered out ({why})", f"{n:,}")
    for reason, n in sorted(summary.dlq_reasons.items()):
        flow.add_row(f"DLQ {reason}", f"{n:,}")
    for kind, n in sorted(summary.actions_by_type.items()):
        flow.add_row(f"actions: {kind}", f"{n:,}")
    console.print(flow)
    for table in summary.scoreboard.tables:
        console.print(table)
    for note in summary.scoreboard.notes:
        console.print(note)
    console.print(f"event-to-action latency: p50 {summary.latency_ms(50):.0f} ms, p99 {summary.latency_ms(99):.0f} ms "
                  f"over {len(summary.latencies_ms)} actions (event produced → action produced)")
    for line in summary.drill:
        console.print(line)


def run_demo(stack: StackSettings, topology_path: Path, duration_s: float, entities: int, seed: int,
             drill: bool = True) -> Summary:
    console = Console()
    topology = load_topology(topology_path)
    simulator = build_simulator(topology, entities=entities, seed=seed)
    summary = run_pipeline(stack, topology_path, simulator, duration_s, console=console, drill=drill)
    print_summary(topology, summary, console)
    (stack.home / f"last_demo_{topology.app}.json").write_text(json.dumps({
        "events_sent": summary.events_sent, "counts": summary.counts, "dlq": summary.dlq_reasons,
        "filtered": summary.filtered,
        "actions": summary.actions_by_type, "figures": summary.scoreboard.figures,
        "latency_ms": {"p50": summary.latency_ms(50), "p99": summary.latency_ms(99)}, "drill": summary.drill,
    }, indent=2, default=str))
    return summary
