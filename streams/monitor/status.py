"""``tangram status --topology FILE``: what a running topology is doing, live or once as JSON.

Per processor: records/s (two scrapes of its ``/metrics``), consumer lag from the broker (the
group's committed offsets against the high watermarks of its inputs), p99 of its batch time
(the ``tangram_processor_batch_duration_seconds`` histogram), dead letters (records in its DLQ
topic). For the topology: the config version and degradation level (config center), the model
versions in each stage (model registry) and the drift flags (the latest ``pm.monitor.drift``
result of every feature). The metrics endpoints come from the launcher's endpoint file
(``streams.launcher.read_endpoints``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from streams.avro import codec
from streams.wire import WireFormatError
from streams.config_center import ConfigCenter
from streams.errors import StackError, TangramError
from streams.launcher import read_endpoints
from streams.lifecycle import ModelRegistry
from streams.monitor.scrape import Scrape, quantile_of_buckets, scrape
from streams.settings import StackSettings
from streams.topology import Topology

log = logging.getLogger("tangram.monitor.status")

BATCH_HISTOGRAM = "tangram_processor_batch_duration_seconds"
RECORDS_IN = "tangram_processor_records_in_total"
RECORDS_OUT = "tangram_processor_records_out_total"
DEAD_LETTERS = "tangram_processor_dead_letters_total"


def _stage(topic: str) -> str:
    parts = topic.split(".")
    return parts[1] if len(parts) >= 3 else ""


class StatusReader:
    """Collects status snapshots of one topology on one stack (keeps its clients between snapshots)."""

    def __init__(self, topology: Topology, stack: StackSettings, timeout_s: float = 5.0):
        self.topology = topology
        self.stack = stack
        self.timeout_s = timeout_s
        self.admin = AdminClient(stack.kafka.config())
        self.consumer = Consumer(stack.kafka.config({"group.id": "tangram-status",
                                                     "enable.auto.commit": False}))
        self.config = ConfigCenter(stack.kafka, timeout_s=timeout_s)
        self.models = ModelRegistry(stack.kafka, timeout_s=timeout_s)
        self._previous: dict[str, tuple[float, float]] = {}  # processor → (monotonic time, records in)

    def close(self) -> None:
        self.consumer.close()
        self.config.close()
        self.models.close()

    # -- pieces ------------------------------------------------------------------------
    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        out = {}
        for p in range(self.topology.partitions(topic)):
            out[p] = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=self.timeout_s)
        return out

    def lag(self, processor: str) -> int:
        """Records in the processor's inputs not yet committed by its group (from the broker)."""
        group = self.topology.group(processor)
        request = ConsumerGroupTopicPartitions(group, [TopicPartition(t, p) for t in self.topology.processors[processor].inputs
                                                       for p in range(self.topology.partitions(t))])
        committed = self.admin.list_consumer_group_offsets([request])[group].result(timeout=self.timeout_s)
        total = 0
        for tp in committed.topic_partitions:
            low, high = self.watermarks(tp.topic)[tp.partition]
            position = tp.offset if tp.offset >= 0 else low
            total += max(0, high - position)
        return total

    def dlq_records(self, processor: str) -> int:
        dlq = self.topology.processors[processor].dlq
        return sum(high - low for low, high in self.watermarks(dlq).values()) if dlq else 0

    def scrapes(self, processor: str, endpoints: list[dict]) -> list[Scrape]:
        out = []
        for e in endpoints:
            if e["name"] == processor and e.get("metrics_url"):
                try:
                    out.append(scrape(e["metrics_url"], timeout_s=self.timeout_s))
                except StackError as exc:
                    log.debug("%s", exc)
        return out

    def config_status(self) -> dict[str, Any]:
        state = self.config.refresh()
        return {"version": state.version,
                "degradation_level": state.get("feature-switch", "degradation.level", None, "L0"),
                "monitor_thresholds": state.namespace("monitor-threshold", None)}

    def model_status(self) -> dict[str, Any]:
        state = self.models.refresh()
        return {name: {"production": m.production, "challenger": m.challenger,
                       "canary_share": m.canary_share if m.challenger else 0.0,
                       "versions": sorted(m.versions, key=lambda v: (len(v), v))}
                for name, m in sorted(state.models.items())}

    def drift_status(self, tail: int = 200) -> dict[str, Any]:
        """The latest result of every monitored feature, from the tail of the drift topic(s)."""
        latest: dict[str, dict] = {}
        for topic, spec in self.topology.topics.items():
            if _stage(topic) != "monitor" or not spec.schema_:
                continue
            drift_codec = codec(self.stack.registry_url, spec.schema_, self.topology.schema(spec.schema_))
            for partition, (low, high) in self.watermarks(topic).items():
                if high <= low:
                    continue
                self.consumer.assign([TopicPartition(topic, partition, max(low, high - tail))])
                remaining = high - max(low, high - tail)
                deadline = time.monotonic() + self.timeout_s
                while remaining > 0 and time.monotonic() < deadline:
                    for msg in self.consumer.consume(min(500, remaining), 0.5):
                        if msg.error():
                            continue
                        remaining -= 1
                        try:
                            r = drift_codec.decode(msg.value())
                        except WireFormatError:
                            continue
                        key = f"{r['monitor']}.{r['feature']}"
                        if key not in latest or r["evaluated_ms"] >= latest[key]["evaluated_ms"]:
                            latest[key] = r
        features = {k: {"drifted": r["drifted"], "consecutive": r["consecutive"], "psi": round(r["psi"], 4),
                        "pvalue": r["pvalue"], "test": r["test"], "evaluated_ms": r["evaluated_ms"]}
                    for k, r in sorted(latest.items())}
        return {"features": features, "drifted": [k for k, f in features.items() if f["drifted"]],
                "evaluated_ms": max((f["evaluated_ms"] for f in features.values()), default=0)}

    # -- the snapshot ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """One status snapshot (JSON-serialisable). Rates need a previous snapshot of this reader."""
        endpoints = read_endpoints(self.stack, self.topology.app)
        now = time.monotonic()
        processors = {}
        for name, spec in self.topology.processors.items():
            scrapes = self.scrapes(name, endpoints)
            records_in = sum(s.total(RECORDS_IN, processor=name) for s in scrapes)
            previous = self._previous.get(name)
            rate = (records_in - previous[1]) / (now - previous[0]) if previous and now > previous[0] else None
            if scrapes:
                self._previous[name] = (now, records_in)
            p99 = _merged_quantile(scrapes, BATCH_HISTOGRAM, 0.99, processor=name)
            processors[name] = {
                "replicas": spec.replicas,
                "up": len(scrapes),
                "metrics": [e["metrics_url"] for e in endpoints if e["name"] == name and e.get("metrics_url")],
                "records_in": records_in if scrapes else None,
                "records_out": sum(s.total(RECORDS_OUT, processor=name) for s in scrapes) if scrapes else None,
                "rate_per_s": None if rate is None else round(max(0.0, rate), 2),
                "p99_ms": None if p99 is None else round(p99 * 1000, 2),
                "dead_letters": sum(s.total(DEAD_LETTERS, processor=name) for s in scrapes) if scrapes else None,
                "lag": self._safe(lambda n=name: self.lag(n)),
                "dlq_records": self._safe(lambda n=name: self.dlq_records(n)),
            }
        return {
            "app": self.topology.app,
            "at_ms": int(time.time() * 1000),
            "processors": processors,
            "config": self._safe(self.config_status),
            "models": self._safe(self.model_status),
            "drift": self._safe(self.drift_status),
        }

    def _safe(self, get: Callable[[], Any]) -> Any:
        """A piece of the snapshot, or ``{"error": ...}`` when its source does not answer."""
        try:
            return get()
        except (KafkaException, TangramError, TimeoutError) as exc:
            return {"error": str(exc)}


def _merged_quantile(scrapes: list[Scrape], name: str, q: float, **labels: str) -> float | None:
    """Quantile of a histogram summed over replicas (buckets add up)."""
    buckets: dict[float, float] = {}
    for s in scrapes:
        for sample in s.select(f"{name}_bucket", **labels):
            le = float(sample.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + sample.value
    return quantile_of_buckets(buckets, q)


def render(snap: dict[str, Any]) -> Group:
    """The rich view of a snapshot."""
    table = Table(title=f"topology {snap['app']}", caption=time.strftime("%H:%M:%S", time.localtime(snap["at_ms"] / 1000)))
    for col in ("processor", "up", "rate/s", "lag", "p99 batch", "dead letters", "DLQ", "metrics"):
        table.add_column(col, justify="left" if col in ("processor", "metrics") else "right")
    for name, p in snap["processors"].items():
        up = f"{p['up']}/{p['replicas']}"
        table.add_row(name, up if p["up"] else f"[red]{up}[/red]", _fmt(p["rate_per_s"]), _fmt(p["lag"]),
                      "-" if p["p99_ms"] is None else f"{p['p99_ms']:.1f} ms", _fmt(p["dead_letters"]),
                      _fmt(p["dlq_records"]), ", ".join(u.removesuffix("/metrics").removeprefix("http://")
                                                       for u in p["metrics"]) or "-")
    cfg, models, drift = snap["config"], snap["models"], snap["drift"]
    lines = Table.grid(padding=(0, 2))
    lines.add_column(style="bold")
    lines.add_column()
    lines.add_row("config", "error: " + cfg["error"] if "error" in cfg else
                  f"version {cfg['version']}, degradation {cfg['degradation_level']}")
    if "error" in models:
        lines.add_row("models", "error: " + models["error"])
    else:
        lines.add_row("models", "; ".join(
            f"{n}: production {m['production'] or '-'}" + (f", challenger {m['challenger']} ({m['canary_share']:.0%})"
                                                            if m["challenger"] else "")
            for n, m in models.items()) or "none registered")
    if "error" in drift:
        lines.add_row("drift", "error: " + drift["error"])
    elif not drift["features"]:
        lines.add_row("drift", "no evaluation yet")
    else:
        flagged = drift["drifted"]
        lines.add_row("drift", ("[red]drifted: " + ", ".join(
            f"{k} (PSI {drift['features'][k]['psi']:.2f}, {drift['features'][k]['consecutive']}x)" for k in flagged)
            + "[/red]") if flagged else f"[green]no drift[/green] in {len(drift['features'])} features")
    return Group(table, lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # {"error": ...}: its source did not answer
        return "[red]?[/red]"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def show(topology: Topology, stack: StackSettings, *, once: bool = False, as_json: bool = False,
         interval_s: float = 2.0, console: Console | None = None) -> dict[str, Any]:
    """Print the status: once (two snapshots ``interval_s`` apart, for the rates) or live until Ctrl-C."""
    console = console or Console()
    reader = StatusReader(topology, stack)
    try:
        reader.snapshot()
        time.sleep(interval_s)
        snap = reader.snapshot()
        if once:
            if as_json:
                sys.stdout.write(json.dumps(snap, indent=2) + "\n")
            else:
                console.print(render(snap))
            return snap
        with Live(render(snap), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval_s)
                    snap = reader.snapshot()
                    live.update(render(snap))
            except KeyboardInterrupt:
                pass
        return snap
    finally:
        reader.close()
