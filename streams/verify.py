"""``tangram verify``: the seeds' four-step verification against the running stack.

1. protocol handshake — a sample reading through the ingest path is accepted,
   a malformed one is rejected to the DLQ with its reason;
2. service connectivity — every external call a processor declares (Triton,
   Redis, the registry) and the broker answer within the declared timeout, and
   the model Triton serves matches its contract;
3. end-to-end chain — readings of a machine with a worn bearing yield a
   maintenance action within the topology's SLA;
4. load and chaos — readings at the declared baseline rate while one processor
   is killed with SIGKILL and restarted: nothing lost, SLA held or the breach reported.

Each check prints what was declared beside what was measured. ``verify`` starts
the topology's processors itself (as the demo does) so that step 4 can kill one.
The probes speak the reference application's telemetry contract.
"""

from __future__ import annotations

import json
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

from streams.avro import codec
from streams.launcher import Processors, high_watermarks, wait_quiet
from streams.plan import apply
from streams.settings import StackSettings
from streams.simulator import SENSORS, Device
from streams.topology import Topology, load_schema, load_topology


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
        self.consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"tangram-verify-{uuid.uuid4().hex}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed"})
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


def _readings(device: Device, start_ms: int, seconds: float, hz: float, rng: np.random.Generator, t0_s: float = 0.0) -> list[tuple[str, bytes, str]]:
    """(key, JSON value, event_id) for ``seconds`` of ``device``'s readings from ``start_ms``."""
    t = t0_s + np.arange(int(seconds * hz)) / hz
    values = device.sample(t, rng)
    out = []
    for k, row in enumerate(values):
        event_id = uuid.uuid4().hex
        reading = {"event_id": event_id, "device_id": device.device_id, "ts": start_ms + int(k * 1000 / hz)}
        reading.update({s: None if np.isnan(v) else float(v) for s, v in zip(SENSORS, row)})
        out.append((device.device_id, json.dumps(reading).encode(), event_id))
    return out


class Verifier:
    def __init__(self, topology_path: Path, stack: StackSettings, console: Console):
        self.path = Path(topology_path)
        self.topology = load_topology(self.path)
        self.stack = stack
        self.console = console
        apply(self.topology, stack)  # idempotent: topics and subjects exist before any probe
        self.rng = np.random.default_rng(int(time.time()))
        ingest = self.topology.processors["ingest"]
        self.raw, self.accepted, self.dlq = ingest.inputs[0], ingest.outputs[0], ingest.dlq
        self.sink = self.topology.sla.sink if self.topology.sla else next(t for t in self.topology.topics if ".actions." in t)
        self.sla_ms = self.topology.sla.p99_ms if self.topology.sla else None
        self.producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 2})
        subject = self.topology.topics[self.sink].schema_
        self.action_codec = codec(stack.registry_url, subject, load_schema(subject))

    # -- step 1 -------------------------------------------------------------------
    def protocol(self) -> list[Check]:
        reader = _Reader(self.stack, self.topology, [self.accepted, self.dlq])
        device = Device.random(f"verify-{uuid.uuid4().hex[:6]}", self.rng)
        key, value, event_id = _readings(device, int(time.time() * 1000), 0.1, 10.0, self.rng)[0]
        sent = time.monotonic()
        self.producer.produce(self.raw, value, key)
        self.producer.produce(self.raw, value[:-9], key)  # truncated JSON
        self.producer.flush(10)
        ok = reader.until(lambda m: m.topic() == self.accepted and _header(m, "event_id") == event_id, 15)
        accepted_ms = (time.monotonic() - sent) * 1000
        bad = reader.until(lambda m: m.topic() == self.dlq and m.key() == key.encode(), 15)
        rejected_ms = (time.monotonic() - sent) * 1000
        reader.close()
        reason = _header(bad, "dlq.reason") if bad else "-"
        return [
            Check("1 protocol", f"valid reading {self.raw} → {self.accepted}", "accepted as Avro",
                  f"accepted in {accepted_ms:.0f} ms" if ok else "not accepted within 15 s", ok is not None),
            Check("1 protocol", f"truncated JSON → {self.dlq}", "rejected with a reason",
                  f"rejected ({reason}) in {rejected_ms:.0f} ms" if bad else "not in the DLQ within 15 s",
                  bad is not None and reason == "bad_json"),
        ]

    # -- step 2 -------------------------------------------------------------------
    def connectivity(self) -> list[Check]:
        checks = []
        t = time.perf_counter()
        AdminClient({"bootstrap.servers": self.stack.bootstrap_servers}).list_topics(timeout=5)
        checks.append(Check("2 connectivity", f"Kafka {self.stack.bootstrap_servers}", "answers within 5000 ms",
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

        name = next(n for n, p in self.topology.processors.items() if p.kind.startswith("inference_workers"))
        worker = InferenceWorker.build(BuildContext(self.topology, name, self.stack))
        try:
            worker.setup()  # reads metadata + config, raises naming the field that differs
        finally:
            worker.close()
        return f"model '{worker.settings.model}' matches its contract"

    # -- step 3 -------------------------------------------------------------------
    def chain(self) -> list[Check]:
        reader = _Reader(self.stack, self.topology, [self.sink])
        device = Device.random(f"verify-{uuid.uuid4().hex[:6]}", self.rng, "bearing_wear", onset_s=-60.0)
        readings = _readings(device, int(time.time() * 1000) - 13_000, 13.0, 10.0, self.rng)
        for key, value, _ in readings:
            self.producer.produce(self.raw, value, key)
        self.producer.flush(10)
        sent = time.monotonic()
        action = reader.until(lambda m: m.key() == device.device_id.encode(), 30)
        ms = (time.monotonic() - sent) * 1000
        reader.close()
        declared = f"maintenance action within p99 {self.sla_ms:g} ms" if self.sla_ms else "a maintenance action"
        if action is None:
            return [Check("3 chain", f"worn bearing on {device.device_id} → {self.sink}", declared, "no action within 30 s", False)]
        rule = self.action_codec.decode(action.value())["rule"]
        return [Check("3 chain", f"worn bearing on {device.device_id} → {self.sink}", declared,
                      f"{rule} after {ms:.0f} ms", self.sla_ms is None or ms <= self.sla_ms)]

    # -- step 4 -------------------------------------------------------------------
    def load_and_chaos(self, processors: Processors, seconds: float, victim: str) -> list[Check]:
        data = self.topology.topics[self.raw].data
        rate = data.baseline_rate if data and data.baseline_rate else 200.0
        hz = 10.0
        n_devices = max(1, int(rate / hz))
        worn = [Device.random(f"load-w{i}-{uuid.uuid4().hex[:4]}", self.rng, "bearing_wear", onset_s=-60.0) for i in range(min(5, n_devices))]
        fleet = worn + [Device.random(f"load-h{i}-{uuid.uuid4().hex[:4]}", self.rng) for i in range(n_devices - len(worn))]
        victim_out = self.topology.processors[victim].outputs[0]
        watched = list(dict.fromkeys([self.accepted, self.sink, victim_out]))
        reader = _Reader(self.stack, self.topology, watched)
        sent_ids: set[str] = set()
        start_ms = int(time.time() * 1000)
        t0 = time.monotonic()
        killed_at = None
        steps = int(seconds * hz)
        for k in range(steps):
            if (delay := t0 + k / hz - time.monotonic()) > 0:
                time.sleep(delay)
            for device in fleet:
                key, value, event_id = _readings(device, start_ms + int(k * 1000 / hz), 1 / hz, hz, self.rng, t0_s=k / hz)[0]
                self.producer.produce(self.raw, value, key)
                sent_ids.add(event_id)
            self.producer.poll(0)
            if killed_at is None and k >= steps // 2:
                processors.kill(victim)
                killed_at = time.time()
                processors.start_one(victim)
        self.producer.flush(30)
        # Anything the victim's outputs carry with a create time after the kill comes from its successor.
        resumed = reader.until(lambda m: m.topic() == victim_out and m.timestamp()[1] / 1000 > killed_at, 90)
        resumed_in = resumed.timestamp()[1] / 1000 - killed_at if resumed else None
        probe = Consumer({"bootstrap.servers": self.stack.bootstrap_servers, "group.id": "tangram-verify-probe"})
        wait_quiet(probe, self.topology, quiet_s=3.0, timeout_s=60.0)
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
            Check("4 load+chaos", f"{len(sent_ids)} readings at {rate:g}/s for {seconds:g}s", "nothing lost",
                  f"{lost} lost, {len(sent_ids) - lost} accepted", lost == 0),
            Check("4 load+chaos", f"{self.raw} → {self.sink} at baseline load",
                  f"p99 ≤ {self.sla_ms:g} ms" if self.sla_ms else "actions flow",
                  f"p99 {steady:.0f} ms over {n_steady} actions", n_steady > 0 and (self.sla_ms is None or steady <= self.sla_ms)),
            Check("4 load+chaos", f"kill -9 {victim} mid-load, restart", f"resumes within {recovery_s:g} s",
                  (f"producing again after {resumed_in:.1f} s; p99 {chaos:.0f} ms over {n_chaos} actions meanwhile"
                   if resumed_in is not None else "did not resume within 90 s"),
                  resumed_in is not None and resumed_in <= recovery_s),
        ]

    def run(self, load_s: float, victim: str) -> list[Check]:
        with Processors(self.path, self.stack) as processors:
            processors.start()
            processors.wait_joined()
            checks = []
            for step in (self.protocol, self.connectivity, self.chain):
                checks.extend(step())
                self.console.print(f"[dim]{checks[-1].step} done[/]")
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
           console: Console | None = None) -> list[Check]:
    console = console or Console()
    checks = Verifier(topology_path, stack, console).run(load_s, victim)
    print_checks(checks, console)
    return checks
