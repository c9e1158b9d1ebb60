"""``tangram plan APP --capacity``: the partitions, replicas, Flink slots and Triton servers an app needs.

The topology declares how fast records arrive (a topic's ``data:`` baseline and peak rates) and how busy a
stage may be (``compute.target_utilization``); ``make bench`` measures what one replica of each kind of stage
carries on this machine (``<TANGRAM_HOME>/bench/results.json``, every figure with its commit). From those:

- the rate each stage must carry: declared on its input topics, or carried down from the topics upstream
  (one record out per record in, except a feature stage, which writes one window per entity every hop:
  ``1 / (sample_hz × hop_s)`` of its feature set);
- a replica's capacity: the bench figure of the stage's kind when the results file has one, else the
  declared ``compute.max_rate_per_replica``, else unknown (said so, not guessed);
- replicas needed at the peak: ``ceil(peak / (capacity × target_utilization))``;
- partitions needed on the stage's inputs: at least the replicas (a consumer group's member reads whole
  partitions), and the plan is refused when an input has fewer;
- Flink parallelism of the feature job (the Flink job's own figure, per slot) and Triton servers behind an
  inference stage (direct tritonclient calls on the same batches, the bench's baseline of the worker).

Pure functions over a :class:`~streams.topology.Topology` and a results file: no broker, no stack.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from streams.topology import Kind, ProcessorSpec, Topology

#: A measured rate in a figure's text: ``35,981 records/s``, ``23,451 rows/s``, ``67,705 readings/s``.
_RATE = re.compile(r"([\d,]+(?:\.\d+)?)\s+(records|readings|rows|events|feature windows|documents)/s")


@dataclass(frozen=True)
class BenchFigure:
    """One figure of a results file, with the rate it states."""

    path: str
    rate: float  # records/s the figure states
    unit: str
    commit: str
    benchmark: str = ""
    n: int = 0
    batch: int | str = ""
    baseline: str = ""

    def cite(self) -> str:
        batch = f", batch {self.batch}" if self.batch not in ("", "-", None) else ""
        return f"bench {self.commit}: {self.path} = {self.rate:,.0f} {self.unit}/s{batch}"


@dataclass(frozen=True)
class Bench:
    """The figures of one results file, in the order they were measured (a later one wins)."""

    figures: tuple[BenchFigure, ...] = ()
    source: str = ""  # the file, or why there is none
    machine: str = ""

    def find(self, prefix: str) -> BenchFigure | None:
        found = [f for f in self.figures if f.path.startswith(prefix)]
        return found[-1] if found else None


def parse_rate(text: str) -> tuple[float, str] | None:
    """The first rate stated in ``text`` and its unit, or None."""
    match = _RATE.search(text or "")
    return (float(match.group(1).replace(",", "")), match.group(2)) if match else None


def load_bench(path: Path) -> Bench:
    """The figures of a ``make bench`` results file (``benchmarks/report.py``); an empty Bench when it is missing."""
    if not path.is_file():
        return Bench(source=f"no results file at {path} (run `make bench`)")
    doc = json.loads(path.read_text())
    figures = []
    for raw in doc.get("figures", []):
        stated = parse_rate(raw.get("measured", ""))
        if stated is None:
            continue
        rate, unit = stated
        if isinstance(raw.get("value"), (int, float)) and raw["value"] > 0:
            rate = float(raw["value"])
        figures.append(BenchFigure(path=raw.get("path", ""), rate=rate, unit=unit, commit=raw.get("commit", "?"),
                                   benchmark=raw.get("benchmark", ""), n=int(raw.get("n") or 0),
                                   batch=raw.get("batch", ""), baseline=raw.get("baseline", "")))
    return Bench(tuple(figures), str(path), doc.get("machine", ""))


@dataclass(frozen=True)
class Rate:
    """A topic's records/s at the baseline and the peak, and where they come from."""

    baseline: float | None
    peak: float | None
    source: str

    @property
    def sizing(self) -> float | None:
        """The rate a plan sizes for: the peak, else the baseline."""
        return self.peak if self.peak is not None else self.baseline


@dataclass(frozen=True)
class Capacity:
    per_replica: float | None
    source: str
    figure: BenchFigure | None = None


@dataclass
class StagePlan:
    name: str
    kind: str
    rate: Rate  # what its inputs carry together
    capacity: Capacity
    target_utilization: float
    replicas_declared: int
    replicas_needed: int | None
    narrowest_input: str
    partitions: int  # of the narrowest input
    flink_parallelism: int | None = None
    flink_source: str = ""
    flink_figure: BenchFigure | None = None
    triton_servers: int | None = None
    triton_source: str = ""
    triton_figure: BenchFigure | None = None
    triton_per_server: float | None = None

    @property
    def partitions_needed(self) -> int | None:
        return self.replicas_needed

    @property
    def fits(self) -> bool:
        return self.replicas_needed is None or self.replicas_needed <= self.partitions

    def drawn(self) -> list[str]:
        """The figures ``tangram diagram --capacity`` writes on this stage: those ``plan --capacity`` prints."""
        def num(value: float | None) -> str:
            return "?" if value is None else f"{value:,.0f}"

        lines = [f"peak {num(self.rate.sizing)}/s, a replica {num(self.capacity.per_replica)}/s at util "
                 f"{self.target_utilization:g}",
                 f"replicas {num(self.replicas_needed)} (declared {self.replicas_declared}), partitions "
                 f"{num(self.partitions_needed)} (have {self.partitions})" + ("" if self.fits else ": TOO FEW")]
        if self.flink_parallelism is not None:
            lines.append(f"Flink slots {self.flink_parallelism}")
        if self.triton_servers is not None:
            lines.append(f"Triton servers {self.triton_servers}")
        return lines


@dataclass
class CapacityPlan:
    app: str
    topics: dict[str, Rate]
    stages: list[StagePlan]
    bench: Bench
    notes: list[str] = field(default_factory=list)

    def refusals(self) -> list[str]:
        """One message per stage whose input's partitions cannot carry the declared peak."""
        out = []
        for s in self.stages:
            if not s.fits:
                out.append(f"processor {s.name!r} needs {s.replicas_needed} replicas to carry {s.rate.sizing:,.0f}/s "
                           f"at utilization {s.target_utilization:g} ({s.capacity.per_replica:,.0f}/s a replica, "
                           f"{s.capacity.source}), but its input {s.narrowest_input!r} has {s.partitions} partitions: "
                           f"declare `partitions: {s.replicas_needed}` (or more) on it")
        return out


def needed(rate: float | None, per_replica: float | None, utilization: float) -> int | None:
    """Units of ``per_replica`` capacity that carry ``rate`` with each busy at most ``utilization``."""
    if rate is None or not per_replica:
        return None
    return max(1, math.ceil(rate / (per_replica * utilization) - 1e-9))


def _out_ratio(topology: Topology, spec: ProcessorSpec) -> tuple[float, str]:
    """Records out per record in, and why."""
    if spec.kind == Kind.FEATURES and spec.params.get("feature_set"):
        from streams.features.spec import load_feature_set

        fs = load_feature_set(topology.path(spec.params["feature_set"]))
        per_window = fs.sample_hz * fs.window.hop_ms / 1000
        return 1 / per_window, (f"feature set: 1 window per {per_window:g} readings "
                                f"({fs.sample_hz:g} Hz × {fs.window.hop_ms} ms hop)")
    return 1.0, "1 out per 1 in (upper bound)"


def topic_rates(topology: Topology) -> dict[str, Rate]:
    """Every topic's rate: declared under ``data:``, else carried down from the processors writing it."""
    rates: dict[str, Rate] = {}
    visiting: set[str] = set()

    def rate(topic: str) -> Rate:
        if topic in rates:
            return rates[topic]
        data = topology.topics[topic].data
        if data and (data.baseline_rate or data.peak_rate):
            found = Rate(data.baseline_rate, data.peak_rate, "declared (data:)")
        elif topic in visiting:
            return Rate(None, None, "cycle")
        else:
            visiting.add(topic)
            base = peak = 0.0
            known_base = known_peak = False
            via = []
            for name, spec in topology.processors.items():
                if topic not in spec.outputs:
                    continue
                ratio, why = _out_ratio(topology, spec)
                for source in spec.inputs:
                    upstream = rate(source)
                    if upstream.baseline is not None:
                        base += upstream.baseline * ratio
                        known_base = True
                    if upstream.sizing is not None:
                        peak += upstream.sizing * ratio
                        known_peak = True
                via.append(f"{name}: {why}")
            visiting.discard(topic)
            found = Rate(base if known_base else None, peak if known_peak else None,
                         "from upstream via " + "; ".join(via) if via and known_peak else "unknown (nothing declared upstream)")
        rates[topic] = found
        return found

    for topic in topology.topics:
        rate(topic)
    return rates


#: The bench figure that measures one replica of each runtime kind (a path prefix of benchmarks/report.py figures).
KIND_FIGURES: dict[str, str] = {
    Kind.INGEST: "ingest validation, Kafka → Kafka",
    Kind.FEATURES: "feature windows: embedded engine",
    Kind.RULES: "rule processor",
    Kind.DRIFT: "drift: one evaluation",
}
#: The Flink feature job's figure, per slot: parallelism 1 of the Flink SQL job, else the PyFlink job.
FLINK_FIGURES = ("feature windows: Flink SQL job, parallelism 1", "feature windows: PyFlink job")
_DIRECT = re.compile(r"direct tritonclient on the same batches ([\d,]+(?:\.\d+)?) rows/s")


def _inference_figure(bench: Bench, spec: ProcessorSpec) -> BenchFigure | None:
    if spec.exactly_once:
        return bench.find(f"inference worker, batch {spec.batch_size}, exactly-once")
    return bench.find(f"inference worker, batch {spec.batch_size} (pipelined")


def replica_capacity(bench: Bench, spec: ProcessorSpec) -> Capacity:
    """One replica's records/s: the bench figure of its kind, else the declaration, else unknown."""
    figure = _inference_figure(bench, spec) if spec.kind == Kind.INFERENCE else (
        bench.find(KIND_FIGURES[spec.kind]) if spec.kind in KIND_FIGURES else None)
    if figure is not None:
        return Capacity(figure.rate, figure.cite(), figure)
    if spec.compute.max_rate_per_replica:
        return Capacity(spec.compute.max_rate_per_replica, "declared (compute.max_rate_per_replica)")
    return Capacity(None, "unknown: no bench figure for this kind, no compute.max_rate_per_replica declared")


def plan_capacity(topology: Topology, bench: Bench | None = None) -> CapacityPlan:
    """The capacity plan of ``topology`` with the per-replica costs of ``bench``."""
    bench = bench or Bench(source="no results file")
    rates = topic_rates(topology)
    stages = []
    for name, spec in topology.processors.items():
        ins = [rates[t] for t in spec.inputs]
        base = [r.baseline for r in ins if r.baseline is not None]
        peak = [r.sizing for r in ins if r.sizing is not None]
        sources = sorted({r.source.split(" via ")[0] for r in ins})
        rate = Rate(sum(base) if base else None, sum(peak) if peak else None,
                    " + ".join(spec.inputs) + f" ({', '.join(sources)})")
        capacity = replica_capacity(bench, spec)
        util = spec.compute.target_utilization
        narrowest = min(spec.inputs, key=topology.partitions)
        stage = StagePlan(name, spec.kind, rate, capacity, util, spec.replicas,
                          needed(rate.sizing, capacity.per_replica, util), narrowest, topology.partitions(narrowest))
        if spec.kind == Kind.FEATURES:
            flink = next((f for p in FLINK_FIGURES if (f := bench.find(p))), None)
            if flink is not None:
                stage.flink_parallelism = needed(rate.sizing, flink.rate, util)
                stage.flink_source, stage.flink_figure = flink.cite() + " (a slot)", flink
            else:
                stage.flink_source = "unknown: no Flink figure in the bench results"
        if spec.kind == Kind.INFERENCE:
            figure = _inference_figure(bench, spec)
            direct = _DIRECT.search(figure.baseline) if figure else None
            if direct:
                per_server = float(direct.group(1).replace(",", ""))
                stage.triton_servers = needed(rate.sizing, per_server, util)
                stage.triton_figure, stage.triton_per_server = figure, per_server
                stage.triton_source = (f"bench {figure.commit}: direct tritonclient, batch {spec.batch_size} = "
                                       f"{per_server:,.0f} rows/s a server")
            else:
                stage.triton_source = "unknown: no direct-tritonclient baseline in the bench results"
        stages.append(stage)
    notes = []
    if not bench.figures:
        notes.append(f"no bench figures ({bench.source}): capacities are the declared ones only")
    if topology.gateways:
        notes.append("gateways write straight to their ingest processor's output; their rate is not in the "
                     "declared rates above unless declared on that topic")
    return CapacityPlan(topology.app, rates, stages, bench, notes)
