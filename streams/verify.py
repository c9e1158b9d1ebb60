"""``tangram verify``: the seeds' four-step verification against the running stack.

1. protocol handshake — a sample event through the ingest path is accepted,
   a malformed one is rejected to the DLQ with its reason;
2. service connectivity — every external call a processor declares (Triton,
   Redis, the registry) and the broker answer within the declared timeout, and
   the model Triton serves matches its contract;
3. end-to-end chain — an incident (a machine with a worn bearing, a forged
   document) yields an action on the SLA's sink within the topology's SLA;
4. load and chaos — events at the declared baseline rate while one processor
   is killed with SIGKILL and restarted: nothing lost, SLA held or the breach reported.

Each check prints what was declared beside what was measured. ``verify`` starts
the topology's processors itself (as the demo does) so that step 4 can kill one.
The events come from the app's simulator (``streams.simulation``): its probe, its
incident and its load, in the app's own contract.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.table import Table

from streams.avro import topic_codec
from streams.launcher import Processors, high_watermarks, wait_quiet
from streams.plan import apply
from streams.errors import TopologyError
from streams.settings import StackSettings
from streams.simulation import build_simulator, flush, producer, run_ticks
from streams.topology import Kind, Topology, load_topology


@dataclass(frozen=True)
class Check:
    step: str
    name: str
    declared: str
    measured: str
    ok: bool


class _Reader:
    """Reads given topics from their current end, collecting records until a predicate holds."""

    def __init__(self, stack: StackSettings, topology: Topology, topics: list[str]):
        self.consumer = Consumer(stack.kafka.config({"group.id": f"tangram-verify-{uuid.uuid4().hex}",
                                                     "enable.auto.commit": False, "isolation.level": "read_committed"}))
        start = high_watermarks(self.consumer, topology, topics)
        self.consumer.assign([TopicPartition(tp.topic, tp.partition, off) for tp, off in start.items()])
        self.records: list = []

    def until(self, predicate, timeout_s: float):
        """The first record matching ``predicate`` (reading on), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for msg in self.records:
            if predicate(msg):
                return msg
        while time.monotonic() < deadline:
            batch = [m for m in self.consumer.consume(500, 0.1) if not m.error()]
            self.records.extend(batch)
            for msg in batch:
                if predicate(msg):
                    return msg
        return None

    def drain(self, quiet_s: float = 1.0) -> list:
        last = time.monotonic()
        while time.monotonic() - last < quiet_s:
            batch = [m for m in self.consumer.consume(500, 0.2) if not m.error()]
            if batch:
                self.records.extend(batch)
                last = time.monotonic()
        return self.records

    def close(self) -> None:
        self.consumer.close()


def _header(msg, name: str) -> str:
    return dict(msg.headers() or []).get(name, b"").decode("utf-8", "replace")


class Verifier:
    def __init__(self, topology_path: Path, stack: StackSettings, console: Console):
        self.path = Path(topology_path)
        self.topology = load_topology(self.path)
        self.stack = stack
        self.console = console
        apply(self.topology, stack)  # idempotent: topics and subjects exist before any probe
        self.simulator = build_simulator(self.topology, entities=1, seed=int(time.time()))
        self.raw = self.topology.simulator.source  # build_simulator checked there is one
        ingest = next((p for p in self.topology.processors.values() if self.raw in p.inputs), None)
        if ingest is None or not ingest.outputs or not ingest.dlq:
            raise TopologyError(f"verify follows the processor reading {self.raw!r} (with an output and a DLQ); "
                                f"app {self.topology.app!r} has none")
        self.accepted, self.dlq = ingest.outputs[0], ingest.dlq
        rules = [t for p in self.topology.processors_of(Kind.RULES).values() for t in p.outputs]
        if self.topology.sla is None and not rules:
            raise TopologyError(f"verify's chain ends at the SLA's sink or a rule processor's output; app "
                                f"{self.topology.app!r} declares neither")
        self.sink = self.topology.sla.sink if self.topology.sla else rules[0]
        self.sla_ms = self.topology.sla.p99_ms if self.topology.sla else None
        self.producer = Producer(stack.kafka.config({"enable.idempotence": True, "linger.ms": 2}))
        self.action_codec = topic_codec(self.topology, stack.registry_url, self.sink)

    # -- step 1 -------------------------------------------------------------------
    def protocol(self) -> list[Check]:
        reader = _Reader(self.stack, self.topology, [self.accepted, self.dlq])
        valid, malformed, expected = self.simulator.probe(int(time.time() * 1000))
        sent = time.monotonic()
        self.producer.produce(self.raw, valid.value, valid.key)
        self.producer.produce(self.raw, malformed.value, malformed.key)
        self.producer.flush(10)
        ok = reader.until(lambda m: m.topic() == self.accepted and _header(m, "event_id") == valid.event_id, 15)
        accepted_ms = (time.monotonic() - sent) * 1000
        bad = reader.until(lambda m: m.topic() == self.dlq and m.key() == malformed.key.encode(), 15)
        rejected_ms = (time.monotonic() - sent) * 1000
        reader.close()
        reason = _header(bad, "dlq.reason") if bad else "-"
        return [
            Check("1 protocol", f"valid event {self.raw} → {self.accepted}", "accepted in its contract",
                  f"accepted in {accepted_ms:.0f} ms" if ok else "not accepted within 15 s", ok is not None),
            Check("1 protocol", f"malformed event → {self.dlq}", f"rejected as {expected}",
                  f"rejected ({reason}) in {rejected_ms:.0f} ms" if bad else "not in the DLQ within 15 s",
                  bad is not None and reason == expected),
        ]

    # -- step 2 -------------------------------------------------------------------
    def connectivity(self) -> list[Check]:
        checks = []
        t = time.perf_counter()
        AdminClient(self.stack.kafka.config()).list_topics(timeout=5)
        checks.append(Check("2 connectivity", f"Kafka {self.stack.kafka}", "answers within 5000 ms",
                            f"{(time.perf_counter() - t) * 1000:.1f} ms", True))
        declared: dict[str, int] = {}
        for spec in self.topology.processors.values():
            for call in spec.calls:
                declared[call.service] = min(declared.get(call.service, call.timeout_ms), call.timeout_ms)
        declared.setdefault("registry", 5000)
        for service, timeout_ms in sorted(declared.items()):
            t = time.perf_counter()
            detail, ok = "", True
            try:
                if service == "redis":
                    redis.Redis.from_url(self.stack.redis_url, socket_timeout=timeout_ms / 1000).ping()
                elif service == "registry":
                    urllib.request.urlopen(f"{self.stack.registry_url}/subjects", timeout=timeout_ms / 1000).read()
                elif service == "triton":
                    detail = self._triton_contract(timeout_ms / 1000)
            except Exception as exc:  # any failure is a failed check, reported as measured
                detail, ok = f"{type(exc).__name__}: {exc}", False
            ms = (time.perf_counter() - t) * 1000
            ok = ok and ms <= timeout_ms
            checks.append(Check("2 connectivity", service, f"answers within {timeout_ms} ms",
                                f"{ms:.1f} ms" + (f"; {detail}" if detail else ""), ok))
        return checks

    def _triton_contract(self, timeout_s: float) -> str:

        from inference_workers.worker import InferenceWorker
        from streams.context import BuildContext

        models = []
        for name in self.topology.processors_of(Kind.INFERENCE):
            worker = InferenceWorker.build(BuildContext(self.topology, name, self.stack))
            try:
                worker.setup()  # reads metadata + config, raises naming the field that differs
            finally:
                worker.close()
            models.append(worker.settings.model)
        if models:
            return f"model(s) {', '.join(models)} match their contract"
        return self._models_ready(timeout_s)

    def _models_ready(self, timeout_s: float) -> str:
        """An app whose models serve its own stages (no inference worker): each model of its repository is ready."""
        import asyncio

        from inference_workers.triton_client import ModelRepository
        from streams.lifecycle.repository import model_dirs

        async def ready() -> dict[str, set[str]]:
            async with ModelRepository(self.stack.triton_grpc_url, timeout_s=timeout_s) as repository:
                return {m.name: await repository.ready_versions(m.name) for m in model_dirs(self.topology.model_repository)}

        served = asyncio.run(ready())
        missing = sorted(name for name, versions in served.items() if not versions)
        if missing:
            raise TopologyError(f"model(s) {', '.join(missing)} not ready in Triton (`tangram apply` installs them)")
        return "model(s) " + ", ".join(f"{n} v{','.join(sorted(v))}" for n, v in sorted(served.items())) + " ready"

    # -- step 3 -------------------------------------------------------------------
    def chain(self) -> list[Check]:
        """An incident sent live, a step at a time: an action for its entity on the SLA's sink, timed as step 4
        times every action (from the ingest of the reading that decided it to the action's write)."""
        reader = _Reader(self.stack, self.topology, [self.sink])
        steps, entity = self.simulator.incident(int(time.time() * 1000))
        t0 = time.monotonic()
        for step, events in enumerate(steps):
            if (delay := t0 + step / self.simulator.rate_hz - time.monotonic()) > 0:
                time.sleep(delay)
            for event in events:
                self.producer.produce(self.raw, event.value, event.key)
            self.producer.poll(0)
        self.producer.flush(10)
        last_sent = time.time() * 1000
        action = reader.until(lambda m: m.key() == entity.encode(), 30)
        reader.close()
        declared = f"an action within p99 {self.sla_ms:g} ms" if self.sla_ms else "an action"
        name = f"incident on {entity} → {self.sink}"
        if action is None:
            return [Check("3 chain", name, declared, "no action within 30 s of its last event", False)]
        rule = self.action_codec.decode(action.value())["rule"]
        created, ingested = action.timestamp()[1], _header(action, "ingest_ms")
        # without the ingest time on the action (a stage that dropped it): from the incident's last send
        ms = created - (int(ingested) if ingested else last_sent)
        since = "its deciding reading's ingest" if ingested else "the incident's last event"
        return [Check("3 chain", name, declared, f"{rule} after {ms:.0f} ms (from {since})",
                      self.sla_ms is None or ms <= self.sla_ms)]

    # -- step 4 -------------------------------------------------------------------
    def load_and_chaos(self, processors: Processors, seconds: float, victim: str) -> list[Check]:
        data = self.topology.topics[self.raw].data
        rate = data.baseline_rate if data and data.baseline_rate else 200.0
        load = self.simulator.load(max(1, int(rate / self.simulator.rate_hz)))
        if victim not in self.topology.processors:
            raise TopologyError(f"verify: no processor {victim!r} to kill in app {self.topology.app!r}")
        victim_out = self.topology.processors[victim].outputs[0]
        watched = list(dict.fromkeys([self.accepted, self.sink, victim_out]))
        reader = _Reader(self.stack, self.topology, watched)
        sent_ids: set[str] = set()
        start_ms = int(time.time() * 1000)
        killed_at = None
        steps = int(seconds * load.rate_hz)
        out = producer(self.stack)
        for step, events in enumerate(run_ticks(load, out, seconds, start_ms)):
            sent_ids.update(e.event_id for e in events)
            if killed_at is None and step >= steps // 2:
                processors.kill(victim)
                killed_at = time.time()
                processors.start_one(victim)
        flush(out, 30)
        # Anything the victim's outputs carry with a create time after the kill comes from its successor.
        resumed = reader.until(lambda m: m.topic() == victim_out and m.timestamp()[1] / 1000 > killed_at, 90)
        resumed_in = resumed.timestamp()[1] / 1000 - killed_at if resumed else None
        probe = Consumer(self.stack.kafka.config({"group.id": "tangram-verify-probe"}))
        wait_quiet(probe, self.topology, timeout_s=120.0)
        probe.close()
        records = reader.drain()
        reader.close()
        got = {_header(m, "event_id") for m in records if m.topic() == self.accepted}
        lost = len(sent_ids - got)
        def p99(before_kill: bool) -> tuple[float, int]:
            lat = [m.timestamp()[1] - int(_header(m, "ingest_ms") or m.timestamp()[1]) for m in records
                   if m.topic() == self.sink and (m.timestamp()[1] / 1000 < killed_at) == before_kill]
            return (float(np.percentile(lat, 99)) if lat else float("nan"), len(lat))

        steady, n_steady = p99(True)
        chaos, n_chaos = p99(False)
        recovery_s = self.topology.sla.recovery_s if self.topology.sla else 30.0
        return [
            Check("4 load+chaos", f"{len(sent_ids)} events at {rate:g}/s for {seconds:g}s", "nothing lost",
                  f"{lost} lost, {len(sent_ids) - lost} accepted", lost == 0 and bool(sent_ids)),
            Check("4 load+chaos", f"{self.raw} → {self.sink} at baseline load",
                  f"p99 ≤ {self.sla_ms:g} ms" if self.sla_ms else "actions flow",
                  f"p99 {steady:.0f} ms over {n_steady} actions", n_steady > 0 and (self.sla_ms is None or steady <= self.sla_ms)),
            Check("4 load+chaos", f"kill -9 {victim} mid-load, restart", f"resumes within {recovery_s:g} s",
                  (f"producing again after {resumed_in:.1f} s; p99 {chaos:.0f} ms over {n_chaos} actions meanwhile"
                   if resumed_in is not None else "did not resume within 90 s"),
                  resumed_in is not None and resumed_in <= recovery_s),
        ]

    def run(self, load_s: float, victim: str, steps: tuple[int, ...] = (1, 2, 3, 4)) -> list[Check]:
        with Processors(self.path, self.stack) as processors:
            processors.start()
            processors.wait_joined()
            checks = []
            for number, step in ((1, self.protocol), (2, self.connectivity), (3, self.chain)):
                if number in steps:
                    checks.extend(step())
                    self.console.print(f"[dim]{checks[-1].step} done[/]")
            if 4 in steps:
                checks.extend(self.load_and_chaos(processors, load_s, victim))
        return checks


def print_checks(checks: list[Check], console: Console) -> None:
    table = Table(title="tangram verify: declared vs measured")
    for col in ("step", "check", "declared", "measured", "result"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.step, c.name, c.declared, c.measured, "[green]pass[/]" if c.ok else "[red]FAIL[/]")
    console.print(table)


def verify(topology_path: Path, stack: StackSettings, load_s: float = 20.0, victim: str = "inference",
           console: Console | None = None, steps: tuple[int, ...] = (1, 2, 3, 4)) -> list[Check]:
    console = console or Console()
    checks = Verifier(topology_path, stack, console).run(load_s, victim, steps)
    print_checks(checks, console)
    return checks
