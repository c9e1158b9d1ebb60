"""Plan-time checks: a constraint the runtime cannot honour is an error before anything is deployed.

The topology carries the seeds' four kinds of constraints (data, compute, state,
evolution). ``violations`` compares them with each other and with what the
runtime will do — batch sizes against the model's ``max_batch_size``, deadlines
against Kafka's poll interval, the SLA against the batching delays on its path,
replicas against partitions, rates against measured capacity — and returns one
message per breach, naming the processor or topic and the numbers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from streams.topology import ProcessorSpec, Topology

MAX_POLL_INTERVAL_MS = 300_000  # what streams.delivery configures


def _model_max_batch(repository: Path, model: str) -> int | None:
    config = repository / model / "config.pbtxt"
    if not config.is_file():
        return None
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(config.read_text(), model_config_pb2.ModelConfig()).max_batch_size


def path(topology: Topology, source: str, sink: str) -> list[str] | None:
    """Processors on the longest path from topic ``source`` to topic ``sink`` (the critical one), or None.

    A processor may read several topics of one chain (the rules read predictions and feature
    windows): the SLA must hold on the longest way through.
    """
    best: list[str] | None = None

    def walk(topic: str, via: list[str], seen: set[str]) -> None:
        nonlocal best
        if topic == sink:
            if best is None or len(via) > len(best):
                best = via
            return
        for name, spec in topology.processors.items():
            if topic in spec.inputs and name not in via:
                for out in spec.outputs:
                    if out not in seen:
                        walk(out, [*via, name], seen | {out})

    walk(source, [], {source})
    return best


def _processor_violations(topology: Topology, name: str, spec: ProcessorSpec) -> list[str]:
    out = []
    for call in spec.calls:
        worst = call.timeout_ms * (call.retries + 1)
        if worst >= MAX_POLL_INTERVAL_MS:
            out.append(f"processor {name!r}: {call.service} calls may take {worst} ms "
                       f"(timeout_ms {call.timeout_ms} × {call.retries + 1} tries), not below Kafka's "
                       f"max.poll.interval.ms {MAX_POLL_INTERVAL_MS}: the group would rebalance")
    model = spec.params.get("model")
    if model:
        repository = topology.model_repository
        limit = _model_max_batch(repository, model)
        if limit is None:
            out.append(f"processor {name!r}: model {model!r} has no config.pbtxt in {repository}")
        elif spec.batch_size > limit:
            out.append(f"processor {name!r}: batch_size {spec.batch_size} exceeds model {model!r} "
                       f"max_batch_size {limit}")
    narrowest = min(spec.inputs, key=topology.partitions)
    if spec.replicas > (partitions := topology.partitions(narrowest)):
        out.append(f"processor {name!r}: {spec.replicas} replicas but input {narrowest!r} has {partitions} "
                   f"partitions; {spec.replicas - partitions} would sit idle")
    for topic in spec.inputs:
        data = topology.topics[topic].data
        capacity = spec.compute.max_rate_per_replica
        if data and data.baseline_rate and capacity:
            planned = spec.replicas * capacity * spec.compute.target_utilization
            if data.baseline_rate > planned:
                out.append(f"processor {name!r}: baseline {data.baseline_rate:g}/s on {topic!r} exceeds "
                           f"{spec.replicas} replica(s) × {capacity:g}/s × utilization "
                           f"{spec.compute.target_utilization:g} = {planned:g}/s")
    if spec.compute.device == "gpu" and shutil.which("nvidia-smi") is None:
        out.append(f"processor {name!r}: declares device gpu, but this machine has no GPU (nvidia-smi not found); "
                   "declare `device: any` to run on whatever is there")
    evo = spec.evolution
    if evo.routing == "single" and evo.canary_share:
        out.append(f"processor {name!r}: canary_share {evo.canary_share} with routing `single`")
    if evo.routing == "canary" and not 0 < evo.canary_share < 1:
        out.append(f"processor {name!r}: routing `canary` needs 0 < canary_share < 1")
    return out


def violations(topology: Topology) -> list[str]:
    """Every declared constraint the runtime cannot honour; empty when the topology is sound."""
    out: list[str] = []
    for name, spec in topology.processors.items():
        out.extend(_processor_violations(topology, name, spec))
    if topology.sla:
        sla = topology.sla
        chain = path(topology, sla.source, sla.sink)
        if chain is None:
            out.append(f"sla: no processor path from {sla.source!r} to {sla.sink!r}")
        else:
            # natural batching: a record waits at most a batch's linger at each stage (streams.delivery)
            waits = sum(min(p.linger_ms, p.max_wait_ms) for p in (topology.processors[n] for n in chain))
            if waits >= sla.p99_ms:
                out.append(f"sla: p99 {sla.p99_ms:g} ms from {sla.source!r} to {sla.sink!r} cannot hold: the "
                           f"micro-batch lingers on the path ({' → '.join(chain)}) alone add up to {waits} ms")
    return out
