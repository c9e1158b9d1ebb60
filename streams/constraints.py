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

from streams.errors import TopologyError
from streams.resilience import worst_case_s
from streams.topology import Kind, ProcessorSpec, Topology

MAX_POLL_INTERVAL_MS = 300_000  # what streams.delivery configures
#: A guarded call blocks its stage's loop (no poll) at most this share of max.poll.interval.ms.
POLL_SHARE = 0.5


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


def _processor_class(topology: Topology, spec: ProcessorSpec) -> type | None:
    try:
        return topology.load_object(spec.kind)
    except TopologyError:
        return None  # `tangram run` says why; here only what the class declares is checked


def _processor_violations(topology: Topology, name: str, spec: ProcessorSpec) -> list[str]:
    out = []
    cls = _processor_class(topology, spec)
    services = getattr(cls, "services", None)
    for call in spec.calls:
        worst = int(worst_case_s(call) * 1000)
        if worst >= MAX_POLL_INTERVAL_MS * POLL_SHARE:
            out.append(f"processor {name!r}: {call.service} calls may take {worst} ms "
                       f"(timeout_ms {call.timeout_ms} × {call.retries + 1} tries and the waits between), not below "
                       f"half of Kafka's max.poll.interval.ms {MAX_POLL_INTERVAL_MS}: the group would rebalance")
        if services is not None and call.service not in services:
            out.append(f"processor {name!r} declares {call.service} calls, but its kind {spec.kind} never calls "
                       f"{call.service} (it calls {', '.join(sorted(services)) or 'nothing'}): nothing would "
                       "execute that declaration; remove it")
        if call.fallback is not None:
            out.append(f"processor {name!r}: {call.service} call declares fallback {call.fallback!r}, which no "
                       "processor executes: when a call fails the stage applies backpressure (nothing lost); what "
                       "the rules decide without the model is declared by their degradation triggers")
    out += _state_violations(topology, name, spec, cls)
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


def _state_violations(topology: Topology, name: str, spec: ProcessorSpec, cls: type | None) -> list[str]:
    """State and evolution constraints only some kinds execute (``hot_reload``, ``models_per_server``,
    ``rollback_rto_s``, the routing), and co-partitioned inputs."""
    out = []
    params, state, evo = spec.params, spec.state, spec.evolution
    inference, rules = spec.kind == Kind.INFERENCE, spec.kind == Kind.RULES
    follows = bool(params.get("follow_registry") or params.get("routing_file"))
    if state.hot_reload:
        live = ((inference and (follows or params.get("follow_degradation")))
                or ((rules or getattr(cls, "reloads_live", False)) and params.get("live_config", True)))
        if not live:
            out.append(f"processor {name!r} declares hot_reload, but nothing of it changes without a restart "
                       "(an inference worker reloads with follow_registry, routing_file or follow_degradation; "
                       "a rule processor, or a kind declaring reloads_live, with live_config)")
    if state.ttl_s is not None:
        if spec.kind != Kind.FEATURES:
            out.append(f"processor {name!r}: state.ttl_s is the online store's key lifetime, which only a features "
                       f"processor writes; {spec.kind} keeps nothing outside Kafka with a TTL")
        elif params.get("feature_set"):
            from streams.features.spec import load_feature_set

            ttl = load_feature_set(topology.path(params["feature_set"])).online.ttl_s
            if ttl != state.ttl_s:
                out.append(f"processor {name!r}: state.ttl_s {state.ttl_s} but its feature set's online.ttl_s is {ttl}, "
                           "which the online store executes; declare the same")
    if state.models_per_server is not None and not inference:
        out.append(f"processor {name!r}: models_per_server is a limit of inference workers (the versions they have "
                   f"Triton keep loaded); {spec.kind} loads no model")
    if inference and state.models_per_server is not None and state.models_per_server < 2 \
            and (follows or evo.routing != "single" or params.get("routing")):
        out.append(f"processor {name!r}: models_per_server {state.models_per_server} leaves no room for a "
                   "challenger or a new version beside production while it switches; declare 2 or more")
    if evo.rollback_rto_s is not None:
        if not (inference and follows):
            out.append(f"processor {name!r} declares rollback_rto_s {evo.rollback_rto_s:g}, but only an inference worker "
                       "that follows the model registry (follow_registry) or a routing_file rolls back live")
        elif state.models_per_server is not None and state.models_per_server < 2:
            out.append(f"processor {name!r}: rollback_rto_s {evo.rollback_rto_s:g} needs the previous version kept "
                       f"loaded beside production (models_per_server ≥ 2, not {state.models_per_server})")
    if evo.routing != "single" and not inference:
        out.append(f"processor {name!r}: evolution.routing {evo.routing!r} is executed by inference workers only")
    if inference and evo.routing != "single" and not follows:
        mode = (params.get("routing") or {}).get("mode", "canary") if params.get("routing") else None
        if mode != evo.routing:
            out.append(f"processor {name!r}: evolution.routing {evo.routing!r} is not what its params route "
                       f"({mode or 'production only'}); declare the routing in params (or follow_registry)")
    if len(spec.inputs) > 1 and getattr(cls, "copartitioned", True):
        counts = {t: topology.partitions(t) for t in spec.inputs}
        if len(set(counts.values())) > 1:
            out.append(f"processor {name!r} keeps state across its inputs, which must be co-partitioned (the same "
                       f"partition count): {', '.join(f'{t} has {n}' for t, n in counts.items())}")
    return out


def _topic_violations(topology: Topology) -> list[str]:
    """``drop_policy``: ``dlq`` is executed by an ingest processor's rate limits (excess to its DLQ), ``never``
    by backpressure everywhere else; a declaration no processor executes is refused."""
    out = []
    for topic, spec in topology.topics.items():
        if spec.data is None:
            continue
        readers = [(n, p) for n, p in topology.processors.items() if topic in p.inputs]
        limited = [n for n, p in readers if p.kind == Kind.INGEST
                   and any((p.params.get("rate_limits") or {}).get(k) for k in ("per_client", "per_device"))]
        if spec.data.drop_policy == "dlq" and not limited:
            out.append(f"topic {topic!r}: drop_policy dlq, but no processor reading it sheds load (an ingest "
                       "processor with rate_limits sends the excess to its DLQ); the runtime applies backpressure: "
                       "declare `never`, or rate limits")
        if spec.data.drop_policy == "never" and limited:
            out.append(f"topic {topic!r}: drop_policy never, but {', '.join(limited)} rate-limits it (the excess goes "
                       "to the DLQ): declare `dlq`")
    return out


def violations(topology: Topology) -> list[str]:
    """Every declared constraint the runtime cannot honour; empty when the topology is sound."""
    out: list[str] = _topic_violations(topology)
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
