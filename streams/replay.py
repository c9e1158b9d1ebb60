"""Replay and backtests: run history through any model version without touching production.

``replay`` copies a range of a live topic (by offsets or by timestamps, per
partition) into a namespace of its own (``streams.namespace``): same keys,
headers, timestamps and partitions. It reads with ``assign`` under a throwaway
group that never commits, so the live consumer groups and topics are untouched.
The simulator's ground truth and the entity tables the processors join (``tables:``)
are copied whole: a table's versions in effect over the range were written before it.

``backtest`` runs the topology's processors over a replayed namespace with a
chosen model version (or several, each in a namespace of its own) in event time,
as fast as the machine allows, then reports actions per type, agreement between
versions, the app's simulator's verdict against its ground truth (for the reference
app: detections, delays, false alarms, precision/recall/F1) and score distributions —
as a table, JSON and a PNG — with a digest of the outputs: the same range through
the same version gives the same digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from streams.avro import topic_codec
from streams.errors import TopologyError
from streams.launcher import Processors, high_watermarks, wait_quiet
from streams.namespace import DELETE, namespaced
from streams.plan import apply
from streams.settings import StackSettings
from streams.simulation import (
    Observed, Simulator, build_simulator, flush, producer, run_ticks, send_run_context,
)
from streams.topology import Kind, Topology, load_topology

#: A run id names folders and topics: letters, digits, ``_`` and ``-`` only (never a path).
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass
class Run:
    """A replayed range: where it came from and the namespace holding it."""

    run_id: str
    prefix: str
    created: str
    source_topology: str
    topic: str
    ranges: dict[int, tuple[int, int]]  # partition → [start, end) offsets in the source topic
    records: int
    seconds: float
    topology: str = ""  # the namespace's topology file
    copied: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


def runs_dir(stack: StackSettings) -> Path:
    return stack.home / "replays"


def _consumer(stack: StackSettings) -> Consumer:
    # A group id is required by librdkafka; this one is never joined (assign) and never commits.
    return Consumer(stack.kafka.config({"group.id": f"tangram-replay-{uuid.uuid4().hex}",
                                        "enable.auto.commit": False, "enable.auto.offset.store": False,
                                        "isolation.level": "read_committed"}))


def resolve_ranges(consumer: Consumer, topic: str, partitions: int, *, start_offset: int | None = None,
                   end_offset: int | None = None, start_ms: int | None = None, end_ms: int | None = None,
                   only: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """[start, end) offsets per partition: explicit offsets, the first offsets at or after timestamps, or all."""
    ranges = {}
    for p in only if only is not None else range(partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)

        def at(ms: int) -> int:
            found = consumer.offsets_for_times([TopicPartition(topic, p, ms)], timeout=10)[0].offset
            return high if found < 0 else found

        start = start_offset if start_offset is not None else at(start_ms) if start_ms is not None else low
        end = end_offset if end_offset is not None else at(end_ms) if end_ms is not None else high
        start, end = max(low, start), min(high, end)
        ranges[p] = (start, max(start, end))
    return ranges


def copy_range(stack: StackSettings, source: str, target: str, ranges: dict[int, tuple[int, int]]) -> int:
    """Copy records, keeping key, value, headers, timestamp and partition; returns the count."""
    consumer = _consumer(stack)
    failures: list[str] = []
    producer = Producer(stack.kafka.config({"enable.idempotence": True, "acks": "all",
                                            "linger.ms": 20, "compression.type": "lz4", "delivery.report.only.error": True,
                                            "on_delivery": lambda err, _: failures.append(str(err)) if err else None}))
    wanted = {p: r for p, r in ranges.items() if r[1] > r[0]}
    consumer.assign([TopicPartition(source, p, lo) for p, (lo, _) in wanted.items()])
    position = {p: lo for p, (lo, _) in wanted.items()}
    copied = 0
    deadline = time.monotonic() + 600
    try:
        while any(position[p] < wanted[p][1] for p in wanted):
            if time.monotonic() > deadline:
                raise TopologyError(f"copy of {source} stalled at {position}")
            for msg in consumer.consume(5000, 1.0):
                if msg.error():
                    continue
                p = msg.partition()
                if msg.offset() >= wanted[p][1]:
                    continue
                position[p] = msg.offset() + 1
                while True:
                    try:
                        producer.produce(target, msg.value(), msg.key(), partition=p, timestamp=msg.timestamp()[1],
                                         headers=msg.headers())
                        break
                    except BufferError:
                        producer.poll(0.05)
                copied += 1
            producer.poll(0)
        if producer.flush(60) or failures:
            raise TopologyError(f"copy to {target} not acknowledged: {failures[:3]}")
    finally:
        consumer.close()
    return copied


def _truth_topic(topology: Topology) -> str | None:
    return topology.simulator.truth if topology.simulator else None


def _record_time(topology: Topology) -> dict:
    """Namespace overrides: every ingest processor judges timestamps against the record's time, not now."""
    return {f"processors/{name}/params/reference_time": "record" for name in topology.processors_of(Kind.INGEST)}


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise TopologyError(f"run id {run_id!r}: use up to 64 letters, digits, _ and -, starting with a letter or digit")
    return run_id


def replay(stack: StackSettings, topology_path: Path, topic: str | None = None, *, run_id: str | None = None,
           start_offset: int | None = None, end_offset: int | None = None, start_ms: int | None = None,
           end_ms: int | None = None, partitions: list[int] | None = None) -> Run:
    """Copy a range of ``topic`` (default: the simulator's source topic) into a new namespace."""
    topology = load_topology(topology_path)
    topic = topic or (topology.simulator.source if topology.simulator else None)
    if topic is None or topic not in topology.topics:
        raise TopologyError(f"{topic!r} is not a topic of {topology_path}" if topic else
                            f"app {topology.app!r} declares no simulator: name the topic to replay (--topic)")
    run_id = check_run_id(run_id or uuid.uuid4().hex[:8])
    prefix = f"r{run_id.lower().replace('-', '_')}"
    folder = runs_dir(stack) / run_id
    if folder.exists():
        raise TopologyError(f"replay run {run_id} exists; `tangram replay delete {run_id}` first")
    ns_path = namespaced(Path(topology_path), prefix, folder / "topology.yaml", _record_time(topology))
    namespace = load_topology(ns_path)
    apply(namespace, stack)
    consumer = _consumer(stack)
    try:
        ranges = resolve_ranges(consumer, topic, topology.partitions(topic), start_offset=start_offset,
                                end_offset=end_offset, start_ms=start_ms, end_ms=end_ms, only=partitions)
        labels = _truth_topic(topology)
        label_ranges = resolve_ranges(consumer, labels, topology.partitions(labels)) if labels else {}
        # the entity tables the processors join, whole: the versions in effect over the range began before it
        tables = {table: resolve_ranges(consumer, table, topology.partitions(table))
                  for table in dict.fromkeys(t for spec in topology.processors.values() for t in spec.tables)}
    finally:
        consumer.close()
    started = time.perf_counter()
    target = prefix + topic[len(topology.app):]
    copied = {target: copy_range(stack, topic, target, ranges)}
    seconds = time.perf_counter() - started
    for whole, whole_ranges in ([(labels, label_ranges)] if labels else []) + list(tables.items()):
        copied[prefix + whole[len(topology.app):]] = copy_range(stack, whole, prefix + whole[len(topology.app):],
                                                                whole_ranges)
    run = Run(run_id=run_id, prefix=prefix, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
              source_topology=str(Path(topology_path).resolve()), topic=topic, ranges=ranges, records=copied[target],
              seconds=seconds, topology=str(ns_path), copied=copied)
    (folder / "run.json").write_text(json.dumps(asdict(run), indent=2))
    return run


def load_run(stack: StackSettings, run_id: str) -> Run:
    path = runs_dir(stack) / check_run_id(run_id) / "run.json"
    if not path.exists():
        raise TopologyError(f"no replay run {run_id!r} under {runs_dir(stack)}; `tangram replay list` shows them")
    raw = json.loads(path.read_text())
    raw["ranges"] = {int(p): tuple(r) for p, r in raw["ranges"].items()}
    return Run(**raw)


def list_runs(stack: StackSettings) -> list[Run]:
    folder = runs_dir(stack)
    return [load_run(stack, p.name) for p in sorted(folder.iterdir())] if folder.exists() else []


def delete_run(stack: StackSettings, run_id: str) -> tuple[list[str], list[str]]:
    """Remove the run's topics and consumer groups (its backtests' included) and its folder."""
    run = load_run(stack, run_id)
    admin = AdminClient(stack.kafka.config())
    mine = lambda name: name.startswith(f"{run.prefix}.") or name.startswith(f"{run.prefix}_")  # noqa: E731
    topics = sorted(t for t in admin.list_topics(timeout=10).topics if mine(t))
    groups = sorted(g.group_id for g in admin.list_consumer_groups().result(timeout=10).valid if mine(g.group_id))
    if groups:
        for _, future in admin.delete_consumer_groups(groups).items():
            future.result(timeout=30)
    if topics:
        for _, future in admin.delete_topics(topics, operation_timeout=30).items():
            future.result(timeout=30)
    shutil.rmtree(runs_dir(stack) / run_id)
    return topics, groups


@dataclass
class VersionResult:
    version: str
    namespace: str
    events: int
    seconds: float  # copying the range into the version's namespace and running every processor over it
    actions: dict[str, int]
    predictions: int
    labels: dict[str, int]
    scores: list[float]
    figures: dict[str, Any]  # the app's simulator's verdict (streams.simulation.Scoreboard.figures)
    digest: str
    verdicts: dict[str, str] = field(default_factory=dict, repr=False)  # input event id → label

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def _read_all(stack: StackSettings, topology: Topology, topics: list[str]) -> list:
    consumer = _consumer(stack)
    ends = high_watermarks(consumer, topology, topics)
    consumer.assign([TopicPartition(tp.topic, tp.partition, 0) for tp in ends])
    remaining = {(tp.topic, tp.partition): end for tp, end in ends.items() if end > 0}
    out = []
    deadline = time.monotonic() + 120
    while remaining and time.monotonic() < deadline:
        for msg in consumer.consume(5000, 0.5):
            if msg.error():
                continue
            out.append(msg)
            key = (msg.topic(), msg.partition())
            if key in remaining and msg.offset() + 1 >= remaining[key]:
                del remaining[key]
    consumer.close()
    return sorted(out, key=lambda m: (m.topic(), m.partition(), m.offset()))


def _digest(prefix: str, messages: list) -> str:
    h = hashlib.sha256()
    for m in messages:
        for part in (m.topic()[len(prefix):].encode(), str(m.partition()).encode(), m.key() or b"", m.value() or b""):
            h.update(len(part).to_bytes(4, "big") + part)
    return h.hexdigest()


def _progress_until_consumed(stack: StackSettings, topology: Topology, topic: str, total: int, console: Console) -> None:
    reader = next((n for n, p in topology.processors.items() if topic in p.inputs), None)
    if reader is None:
        raise TopologyError(f"no processor of app {topology.app!r} reads the replayed topic {topic!r}")
    probe = Consumer(stack.kafka.config({"group.id": topology.group(reader),
                                         "enable.auto.commit": False}))
    tps = [TopicPartition(topic, p) for p in range(topology.partitions(topic))]
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
               TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"{topology.app}: ingesting", total=total)
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                try:
                    done = sum(max(0, tp.offset) for tp in probe.committed(tps, timeout=10))
                except KafkaException:
                    done = 0
                progress.update(task, completed=done)
                if done >= total:
                    return
                time.sleep(0.3)
    finally:
        probe.close()


def run_version(stack: StackSettings, run: Run, version: str, console: Console) -> VersionResult:
    """Backtest one model version over the run's range, in a namespace of its own."""
    tag = uuid.uuid4().hex[:4]
    prefix = f"{run.prefix}_{tag}v{''.join(c for c in version if c.isalnum())}"
    folder = runs_dir(stack) / run.run_id
    source_app = load_topology(run.source_topology)
    overrides: dict[str, Any] = _record_time(source_app)
    for name in source_app.processors_of(Kind.INFERENCE):  # one version, no canary or shadow
        overrides[f"processors/{name}/params/model_version"] = version
        overrides[f"processors/{name}/params/routing"] = DELETE
        # the version asked for, whatever the live registry or degradation switch says (and so nothing to reload)
        for live in ("params/follow_registry", "params/follow_degradation", "state/hot_reload",
                     "evolution/rollback_rto_s"):
            overrides[f"processors/{name}/{live}"] = DELETE
    path = namespaced(Path(run.source_topology), prefix, folder / f"backtest-{prefix}.yaml", overrides)
    topology = load_topology(path)
    apply(topology, stack)
    source = load_topology(run.topology)
    consumer = _consumer(stack)
    try:
        ends = high_watermarks(consumer, source, list(run.copied))
    finally:
        consumer.close()
    started = time.perf_counter()  # the rate counts the copy into the version's namespace too
    for replayed in run.copied:
        ranges = {tp.partition: (0, end) for tp, end in ends.items() if tp.topic == replayed}
        copy_range(stack, replayed, prefix + replayed[len(run.prefix):], ranges)
    raw = prefix + run.topic[len(source_app.app):]
    quiet_s = 2.0
    with Processors(path, stack) as processors:
        processors.start()
        processors.wait_joined()
        _progress_until_consumed(stack, topology, raw, run.records, console)
        probe = _consumer(stack)
        wait_quiet(probe, topology, quiet_s=quiet_s, timeout_s=300)
        probe.close()
    seconds = time.perf_counter() - started - quiet_s  # the quiet spell only confirms the end
    action_topics = list(dict.fromkeys(t for p in topology.processors_of(Kind.RULES).values() for t in p.outputs))
    prediction_topics = list(dict.fromkeys(p.outputs[0] for p in topology.processors_of(Kind.INFERENCE).values()))
    messages = _read_all(stack, topology, action_topics + prediction_topics)
    decoded = {t: topic_codec(topology, stack.registry_url, t) for t in action_topics + prediction_topics}
    actions = [{**decoded[m.topic()].decode(m.value()), "_topic": m.topic()} for m in messages if m.topic() in action_topics]
    predictions = [decoded[m.topic()].decode(m.value()) for m in messages if m.topic() in prediction_topics]
    truth: list[dict] = []
    if truth_topic := _truth_topic(topology):
        truth_codec = topic_codec(topology, stack.registry_url, truth_topic)
        latest = {m.key(): truth_codec.decode(m.value()) for m in _read_all(stack, topology, [truth_topic])}
        seen = {m.key() for m in messages}
        truth = [record for key, record in latest.items() if key in seen]
    simulator = build_simulator(topology)
    board = simulator.score(Observed(start_ms=0, truth=truth, actions=actions, predictions=predictions))
    return VersionResult(
        version=version, namespace=prefix, events=run.records, seconds=seconds,
        actions=dict(Counter(a["action_type"] for a in actions)), predictions=len(predictions),
        labels=dict(Counter(p["label"] for p in predictions)), scores=[p["score"] for p in predictions],
        figures=board.figures,
        digest=_digest(prefix, [m for m in messages if m.topic() in action_topics]),
        # the prediction's id is <model>:<version>:<input event id>: versions agree or not on the same input
        verdicts={p["event_id"].split(":", 2)[-1]: p["label"] for p in predictions},
    )


def agreement(a: VersionResult, b: VersionResult) -> float:
    common = set(a.verdicts) & set(b.verdicts)
    return sum(a.verdicts[k] == b.verdicts[k] for k in common) / len(common) if common else float("nan")


def backtest(stack: StackSettings, run_id: str, versions: list[str], console: Console | None = None,
             out: Path | None = None) -> list[VersionResult]:
    """Run each version over the replayed range; print, and write ``report.json`` and ``report.png``."""
    console = console or Console()
    run = load_run(stack, run_id)
    results = [run_version(stack, run, v, console) for v in versions]
    out = out or runs_dir(stack) / run_id
    report = {
        "run": asdict(run),
        "versions": [{k: v for k, v in asdict(r).items() if k not in ("scores", "verdicts")} | {"events_per_s": r.rate}
                     for r in results],
        "agreement": {f"{a.version} vs {b.version}": agreement(a, b) for i, a in enumerate(results) for b in results[i + 1:]},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(results, out / "report.png")
    print_report(run, results, report["agreement"], console)
    return results


def _plot(results: list[VersionResult], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    bins = np.linspace(0, 1, 21)
    for r in results:
        left.hist(r.scores, bins=bins, alpha=0.5, label=f"v{r.version}")
    left.set(title="score distribution", xlabel="prediction score", ylabel="predictions", yscale="log")
    left.legend()
    kinds = sorted({k for r in results for k in r.actions})
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        right.bar(np.arange(len(kinds)) + i * width, [r.actions.get(k, 0) for k in kinds], width, label=f"v{r.version}")
    right.set_xticks(np.arange(len(kinds)) + width * (len(results) - 1) / 2, kinds)
    right.set(title="actions per type", ylabel="actions")
    right.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)


def print_report(run: Run, results: list[VersionResult], agreements: dict[str, float], console: Console) -> None:
    table = Table(title=f"backtest of run {run.run_id}: {run.records:,} events of {run.topic}")
    table.add_column("")
    for r in results:
        table.add_column(f"model v{r.version}", justify="right")
    shown = [k for k in dict.fromkeys(k for r in results for k in r.figures)
             if all(isinstance(r.figures.get(k, ""), (str, int, float)) for r in results)]
    rows = [
        ("events/s", lambda r: f"{r.rate:,.0f}"),
        ("predictions", lambda r: f"{r.predictions:,}"),
        *[(f"actions: {k}", (lambda k: lambda r: f"{r.actions.get(k, 0):,}")(k))
          for k in sorted({k for r in results for k in r.actions})],
        *[(k, (lambda k: lambda r: str(r.figures.get(k, "-")))(k)) for k in shown],
        ("digest of actions", lambda r: r.digest[:16]),
    ]
    for name, cell in rows:
        table.add_row(name, *[cell(r) for r in results])
    console.print(table)
    for pair, value in agreements.items():
        console.print(f"agreement of window labels, {pair}: {value:.1%}")


def simulate_history(stack: StackSettings, simulator: Simulator, seconds: float,
                     end_ms: int | None = None) -> tuple[int, int]:
    """Produce ``seconds`` of the simulator's events ending at ``end_ms`` (default now), as fast as possible.

    Record timestamps follow the simulated clock, as if the events had arrived live; the ground
    truth goes to the truth topic. Returns (events, start_ms).
    """
    end_ms = end_ms or int(time.time() * 1000)
    start_ms = end_ms - int(seconds * 1000)
    out = producer(stack, **{"linger.ms": 20})
    send_run_context(stack, simulator, start_ms, out)
    sent = sum(len(events) for events in run_ticks(simulator, out, seconds, start_ms, realtime=False, timestamps=True))
    flush(out, 60)
    return sent, start_ms
