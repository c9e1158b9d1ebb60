"""``tangram diagram``: the topology drawn from the same file the runtime runs, so it is never stale.

Processors are grouped by the seven pieces of an AI application (ingress,
features, model serving, orchestration, …) and annotated with their declared
constraints; topics are the edges, labelled with their Avro subject and rates;
external services hang off the processors that call them, labelled with the
deadline. Output: Graphviz DOT → SVG and PNG (``dot`` from Debian's graphviz),
and Mermaid text for Markdown. Each picture carries the digest of its DOT source,
so a test can tell when a checked-in picture is out of date.
"""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

from streams.capacity import CapacityPlan, StagePlan
from streams.errors import TopologyError
from streams.topology import ProcessorSpec, Topology

PIECES: dict[str, str] = {  # module prefix of a processor kind → seed node
    "streams.ingest": "1 · Data ingress gateway",
    "streams.gateway": "1 · Data ingress gateway",
    "streams.features": "2 · Feature pipeline",
    "inference_workers": "3 · Model serving",
    "streams.rules": "4 · Business orchestrator",
    "streams.drift": "6 · Observability",
    "streams.monitor": "6 · Observability",
    "streams.lifecycle": "7 · Model lifecycle",
}
COLOURS = {"1": "#e8f1fb", "2": "#eaf6ec", "3": "#fdf0e6", "4": "#f3ecfa", "6": "#fbeaea", "7": "#eef6f6"}
DIGEST_KEY = "tangram-digest"


def piece(spec: ProcessorSpec) -> str:
    module = spec.kind.partition(":")[0]
    for prefix, name in PIECES.items():
        if module.startswith(prefix):
            return name
    return "· Other processors"


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _rate(topology: Topology, topic: str) -> str:
    data = topology.topics[topic].data
    if not data or not data.baseline_rate:
        return ""
    peak = f", peak {data.peak_rate:g}/s" + (f" for {data.peak_duration_s:g}s" if data.peak_duration_s else "") if data.peak_rate else ""
    return f"\\n{data.baseline_rate:g}/s{peak}, drop: {data.drop_policy}"


def _processor_label(name: str, spec: ProcessorSpec, stage: StagePlan | None = None) -> str:
    lines = [name, spec.kind.partition(":")[2]]
    lines.append(f"batch ≤{spec.batch_size}, wait ≤{spec.max_wait_ms} ms" + (f", ×{spec.replicas}" if spec.replicas > 1 else ""))
    lines.append(("exactly-once" if spec.exactly_once else "at-least-once") + f", device {spec.compute.device}")
    if spec.state.models_per_server or spec.state.hot_reload or spec.state.ttl_s:
        bits = [f"{spec.state.models_per_server} models" if spec.state.models_per_server else "",
                "hot reload" if spec.state.hot_reload else "", f"TTL {spec.state.ttl_s}s" if spec.state.ttl_s else ""]
        lines.append(", ".join(b for b in bits if b))
    evo = spec.evolution
    if evo.routing != "single" or evo.rollback_rto_s:
        share = f" {evo.canary_share:.0%}" if evo.routing == "canary" else ""
        rto = f", rollback ≤{evo.rollback_rto_s:g}s" if evo.rollback_rto_s else ""
        lines.append(f"routing {evo.routing}{share}{rto}")
    if stage is not None:
        lines += stage.drawn()
    return "\\n".join(_esc(line) for line in lines)


def to_dot(topology: Topology, capacity: CapacityPlan | None = None) -> str:
    """The topology as a Graphviz digraph (deterministic: same file, same text); with ``capacity``, each stage
    carries the figures of ``tangram plan --capacity``."""
    stages = {s.name: s for s in capacity.stages} if capacity is not None else {}
    out = [
        f'digraph "{topology.app}" {{',
        '  graph [rankdir=LR, fontname="Helvetica", fontsize=11, nodesep=0.4, ranksep=0.9, '
        f'label="{_esc(topology.app)}: {_esc(topology.description)}'
        + (f"\\nSLA: p99 ≤ {topology.sla.p99_ms:g} ms from {topology.sla.source} to {topology.sla.sink}" if topology.sla else "")
        + '", labelloc=t];',
        '  node [fontname="Helvetica", fontsize=10, shape=box, style="rounded,filled", fillcolor=white];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    groups: dict[str, list[str]] = {}
    for name, spec in topology.processors.items():
        groups.setdefault(piece(spec), []).append(name)
    for i, (group, names) in enumerate(sorted(groups.items())):
        colour = COLOURS.get(group[0], "#f4f4f4")
        out.append(f'  subgraph "cluster_{i}" {{ label="{_esc(group)}"; style="rounded,filled"; fillcolor="{colour}"; color="#bbbbbb";')
        for name in names:
            label = _processor_label(name, topology.processors[name], stages.get(name))
            out.append(f'    "p:{name}" [label="{label}"];')
        out.append("  }")
    produced = {t for spec in topology.processors.values() for t in spec.outputs}
    consumed = {t for spec in topology.processors.values() for t in spec.inputs}
    dlqs = {spec.dlq for spec in topology.processors.values() if spec.dlq}
    if consumed - produced:
        out.append('  "producers" [shape=cds, fillcolor="#dddddd", label="producers"];')
    if (produced - consumed) - dlqs:
        out.append('  "subscribers" [shape=cds, fillcolor="#dddddd", label="subscribers"];')
    if dlqs:
        out.append('  "dlq" [shape=cylinder, fillcolor="#ffe0e0", label="dead letters\\n(original bytes + reason)"];')
    for topic in topology.topics:
        spec = topology.topics[topic]
        label = f"{_esc(topic)}\\n{_esc(spec.schema_ or spec.format)}{_rate(topology, topic)}"
        writers = [f"p:{n}" for n, p in topology.processors.items() if topic in p.outputs and topic != p.dlq]
        readers = [f"p:{n}" for n, p in topology.processors.items() if topic in p.inputs]
        if topic in dlqs:
            for n, p in topology.processors.items():
                if p.dlq == topic:
                    out.append(f'  "p:{n}" -> "dlq" [label="{_esc(topic)}", style=dashed, color="#cc4444", fontcolor="#cc4444"];')
            continue
        joiners = [f"p:{n}" for n, p in topology.processors.items() if topic in p.tables]
        if joiners:  # a table: its writers (or producers) fill it, each joiner holds all of it
            out.append(f'  "t:{topic}" [shape=cylinder, fillcolor="#e3f0ff", label="table\\n{label}"];')
            for w in writers or ["producers"]:
                out.append(f'  "{w}" -> "t:{topic}";')
            for j in joiners:
                out.append(f'  "t:{topic}" -> "{j}" [label="join", style=dashed, color="#3366aa", fontcolor="#3366aa"];')
            continue
        writers = writers or (["producers"] if readers else [])
        readers = readers or (["subscribers"] if writers and writers != ["producers"] else [])
        for w in writers:
            for r in readers:
                out.append(f'  "{w}" -> "{r}" [label="{label}"];')
    services = sorted({c.service for p in topology.processors.values() for c in p.calls})
    for service in services:
        out.append(f'  "s:{service}" [shape=cylinder, fillcolor="#fff7d6", label="{service}"];')
    for name, spec in topology.processors.items():
        for call in spec.calls:
            extra = [f"timeout {call.timeout_ms} ms"]
            if call.retries:
                extra.append(f"{call.retries} retries")
            if call.circuit_breaker:
                extra.append(f"breaker {call.circuit_breaker.failures} fails / {call.circuit_breaker.reset_s:g}s")
            extra.append(f"fallback {call.fallback}" if call.fallback else "no fallback")
            out.append(f'  "p:{name}" -> "s:{call.service}" [style=dotted, dir=both, arrowsize=0.6, '
                       f'label="{_esc(", ".join(extra))}"];')
    out.append("}")
    return "\n".join(out) + "\n"


def to_mermaid(topology: Topology, capacity: CapacityPlan | None = None) -> str:
    """The same graph as Mermaid flowchart text, for Markdown pages."""
    lines = ["flowchart LR"]
    ident = {name: f"p_{i}" for i, name in enumerate(topology.processors)}
    stages = {s.name: s for s in capacity.stages} if capacity is not None else {}
    for name, spec in topology.processors.items():
        drawn = "".join(f"<br/>{line}" for line in stages[name].drawn()) if name in stages else ""
        lines.append(f'  {ident[name]}["{name}<br/>batch ≤{spec.batch_size}, wait ≤{spec.max_wait_ms} ms{drawn}"]')
    for topic in topology.topics:
        spec = topology.topics[topic]
        writers = [ident[n] for n, p in topology.processors.items() if topic in p.outputs and topic != p.dlq]
        readers = [ident[n] for n, p in topology.processors.items() if topic in p.inputs]
        label = f"{topic}<br/>{spec.schema_ or spec.format}"
        if joiners := [ident[n] for n, p in topology.processors.items() if topic in p.tables]:
            table = f't_{len(lines)}[("table {label}")]'
            for w in writers or ["producers([producers])"]:
                lines.append(f"  {w} --> {table}")
                table = table.split("[")[0]
            for j in joiners:
                lines.append(f'  {table.split("[")[0]} -.->|"join"| {j}')
            continue
        if any(p.dlq == topic for p in topology.processors.values()):
            for n, p in topology.processors.items():
                if p.dlq == topic:
                    lines.append(f'  {ident[n]} -.->|"{topic}"| dlq[("dead letters")]')
            continue
        for w in writers or (["producers([producers])"] if readers else []):
            for r in readers or (["subscribers([subscribers])"] if writers else []):
                lines.append(f'  {w} -->|"{label}"| {r}')
    for name, spec in topology.processors.items():
        for call in spec.calls:
            lines.append(f'  {ident[name]} <-.->|"timeout {call.timeout_ms} ms"| s_{call.service}[("{call.service}")]')
    return "\n".join(lines) + "\n"


def digest(dot: str) -> str:
    return hashlib.sha256(dot.encode()).hexdigest()[:16]


def _png_with_text(png: bytes, key: str, value: str) -> bytes:
    """``png`` with a tEXt chunk ``key=value`` inserted before IEND."""
    data = key.encode("latin-1") + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data) & 0xFFFFFFFF)
    end = png.rindex(b"IEND") - 4
    return png[:end] + chunk + png[end:]


def png_text(png: bytes, key: str) -> str | None:
    """The value of a tEXt chunk of ``png``, if present."""
    pos = 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind = png[pos + 4:pos + 8]
        if kind == b"tEXt":
            k, _, v = png[pos + 8:pos + 8 + length].partition(b"\0")
            if k.decode("latin-1") == key:
                return v.decode("latin-1")
        pos += 12 + length
    return None


def render(topology: Topology, base: Path, formats: tuple[str, ...] = ("svg", "png", "mmd"),
           capacity: CapacityPlan | None = None) -> list[Path]:
    """Write ``base.<fmt>`` for each format (with ``capacity``: each stage's sizing); returns the paths written."""
    dot = to_dot(topology, capacity)
    tag = digest(dot)
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        target = base.with_suffix(f".{fmt}")
        if fmt == "mmd":
            target.write_text(f"%% {DIGEST_KEY}: {tag}\n" + to_mermaid(topology, capacity))
        elif fmt == "dot":
            target.write_text(dot)
        else:
            if shutil.which("dot") is None:
                raise TopologyError("rendering needs Graphviz's `dot` (apt-get install graphviz); Mermaid text needs nothing")
            result = subprocess.run(["dot", f"-T{fmt}"], input=dot.encode(), capture_output=True, timeout=60)
            if result.returncode != 0:
                raise TopologyError(f"dot failed: {result.stderr.decode(errors='replace')}")
            if fmt == "svg":
                target.write_text(f"<!-- {DIGEST_KEY}: {tag} -->\n" + result.stdout.decode())
            elif fmt == "png":
                target.write_bytes(_png_with_text(result.stdout, DIGEST_KEY, tag))
            else:
                target.write_bytes(result.stdout)
        written.append(target)
    return written
