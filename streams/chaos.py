"""``tangram chaos APP``: a fault campaign against the running topology under load, with every event accounted for.

The campaign runs the app's processors (a namespaced copy of its topology: fresh topics and consumer
groups, nothing of the live app touched) on the local stack, drives them with the app's simulator at a
steady rate (``Simulator.load``: every event valid, so every dead letter is a finding), and injects the
faults one after the other:

- ``kill:<processor>``: ``kill -9`` of the processor's process group, restarted at once;
- ``freeze:redis`` / ``freeze:triton``: SIGSTOP for ``fault_s``, then SIGCONT. Triton's is the real
  ``tritonserver`` process and its backend stubs (PyTriton's wrapper process serves nothing);
- ``stop:redis`` / ``stop:triton``: the server stopped for ``fault_s``, then started again;
- ``kill:broker``: ``kill -9`` of the Kafka broker, restarted after ``fault_s``. On a stack of several
  nodes (``TANGRAM_KAFKA_BROKERS=3``) it is node 1, one broker of three, and the campaign's copy of the
  topology replicates every topic min(3, nodes) times with one fewer in sync (unless the app declares more);
  the node stays down at least until the chain has caught up without it (how long that took is in the note);
- ``disk-full:broker``: the filesystem under the Kafka node's log directory filled to the last byte for
  ``fault_s`` (a file written until ``ENOSPC``), then emptied; a node that stopped itself over it (Kafka
  takes a log directory that fails a write offline, and stops when none is left) is started again. It
  needs the log directory on a filesystem of its own (``kafka.disk_filesystem``), or it would fill the
  machine's disk: the campaign refuses to run it otherwise;
- ``registry-at-start:<processor>``: the schema registry stopped, the processor killed and restarted
  while it is down, the registry started ``fault_s`` later (the processor must start then);
- ``oversize``: one record just under the producer's size limit (its dead letter, with the DLQ
  headers, is over it) and one over it (the broker refuses it: never sent, counted apart).

After each fault the campaign waits until the pipeline caught up: every processor's group committed
past what its inputs held when the fault ended. That wait is the fault's **recovery time** (the
features processor's commits trail its open windows by design: one window and its lateness).

At the end (the load stopped, the topics quiet) it accounts for every event by id — again every 5 s
while an output is missing, up to the recovery timeout, since a processor restarted late delivers after
its restart: sent (acknowledged by the broker — the accounting refuses to pass on nothing sent, or on
fewer acknowledged than produced), accepted by the first stage,
dead-lettered (with the stage and reason), duplicated, lost; then the windows the feature stage must
have emitted from the accepted readings (each complete: its reading count), and one prediction per
window (:mod:`streams.accounting`). Exactly-once mode (``--exactly-once``) runs every processor with Kafka transactions.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from rich.console import Console
from rich.table import Table

from streams.accounting import Accounting, Audit, event_id
from streams.errors import StackError, TopologyError
from streams.launcher import Processors, high_watermarks, uncommitted, wait_quiet
from streams.namespace import namespaced
from streams.plan import apply
from streams.settings import StackSettings
from streams.simulation import build_simulator
from streams.stack import components
from streams.stack.kafka import kafka_disk
from streams.stack.process import ManagedProcess
from streams.topology import Topology, load_topology

#: The campaign of ``make test`` (a few minutes) and the long one of docs/guarantees.md.
SHORT = ("kill:ingest", "kill:features", "kill:inference", "kill:rules", "freeze:redis", "freeze:triton",
         "kill:broker", "registry-at-start:rules", "oversize")
LONG = ("kill:ingest", "kill:features", "kill:inference", "kill:rules", "kill:drift", "kill:canary",
        "freeze:redis", "stop:redis", "freeze:triton", "stop:triton", "kill:broker", "registry-at-start:rules",
        "registry-at-start:inference", "oversize")


@dataclass
class FaultResult:
    fault: str
    started_s: float  # seconds since the load started
    lasted_s: float  # from the fault's start to its end (restart, resume)
    recovery_s: float | None  # from the fault's end until every group caught up (None: not within the timeout)
    note: str = ""


@dataclass
class Report:
    app: str
    exactly_once: bool
    rate: float
    duration_s: float
    faults: list[FaultResult]
    accounting: Accounting
    brokers: int = 1
    replication: int = 1  # of the load's topic, as the campaign's copy of the topology declares it
    settled_s: float = 0.0  # from the topics going quiet after the load until every output was there (or the timeout)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


class _Load(threading.Thread):
    """The simulator's events at a steady rate; counts what the broker acknowledged, by event id."""

    def __init__(self, stack: StackSettings, topology: Topology, rate: float, seed: int):
        super().__init__(daemon=True, name="chaos-load")
        self.topology = topology
        self.source = topology.simulator.source
        hz = build_simulator(topology, entities=1, seed=seed).rate_hz
        entities = max(1, round(rate / hz))  # paced by the simulator's own clock: event time follows wall time
        self.simulator = build_simulator(topology, entities=entities, seed=seed).load(entities)
        self.rate = entities * hz
        self.acked: Counter = Counter()
        self.produced = 0
        self.failed: list[str] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()
        # a producer that outlives a broker restart: it retries until delivery.timeout.ms
        self.producer = Producer(stack.kafka.config({"enable.idempotence": True,
                                  "acks": "all", "linger.ms": 5, "delivery.timeout.ms": 300_000,
                                  "on_delivery": self._delivered}))
        self.started = time.monotonic()

    def _delivered(self, err: KafkaError | None, msg) -> None:  # noqa: ANN001 - confluent-kafka's Message
        event = event_id(msg.value())
        with self._lock:
            if err is None:
                self.acked[event] += 1
            else:
                self.failed.append(f"{event}: {err.str()}")

    def run(self) -> None:
        step = 0
        start_ms = int(time.time() * 1000)
        interval = 1 / self.simulator.rate_hz
        next_at = time.monotonic()
        while not self._halt.is_set():
            for event in self.simulator.tick(step, start_ms):
                while True:
                    try:
                        self.producer.produce(self.source, event.value, event.key)
                        self.produced += 1
                        break
                    except BufferError:
                        self.producer.poll(0.1)
            self.producer.poll(0)
            step += 1
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        left = self.producer.flush(120)
        if left:
            self.failed.append(f"{left} records not acknowledged 120 s after the load stopped")
        if not self.is_alive():
            # its on_delivery is a bound method of this load: a cycle through the C object that is never
            # collected, so the producer would go on reconnecting to a stopped stack in the caller's process
            self.producer.close()


class Campaign:
    """One fault campaign (see the module's doc)."""

    def __init__(self, app: Path, stack: StackSettings, *, faults: tuple[str, ...] = SHORT, rate: float = 200.0,
                 fault_s: float = 8.0, recovery_timeout_s: float = 120.0,
                 exactly_once: bool = False, seed: int = 11, console: Console | None = None):
        self.app = Path(app)
        self.stack = stack
        self.faults = faults
        self.rate = rate
        self.fault_s = fault_s
        self.recovery_timeout_s = recovery_timeout_s
        self.exactly_once = exactly_once
        self.seed = seed
        self.console = console or Console()
        self.prefix = f"chaos{uuid.uuid4().hex[:6]}"
        self._folder = tempfile.TemporaryDirectory(prefix="tangram-chaos-")
        original = load_topology(self.app)
        overrides = {f"processors/{n}/exactly_once": True for n in original.processors} if exactly_once else {}
        # On a stack of several brokers the app's topics are replicated as production would have them, so that
        # a broker's loss is one Kafka survives: min(3, brokers) replicas, one fewer in sync for an acknowledgement.
        replicas = min(3, stack.kafka_brokers)
        if original.defaults.replication_factor < replicas:
            overrides |= {"defaults/replication_factor": replicas, "defaults/min_insync_replicas": replicas - 1}
        self.path = namespaced(self.app, self.prefix, Path(self._folder.name) / "topology.yaml", overrides)
        self.topology = load_topology(self.path)
        if faults in (SHORT, LONG):  # the presets name the reference app's processors: those the app has
            self.faults = faults = tuple(f for f in faults if f.partition(":")[0] not in ("kill", "registry-at-start")
                                         or f.partition(":")[2] in ("broker", *self.topology.processors))
        for fault in faults:
            kind, _, target = fault.partition(":")
            if kind in ("kill", "registry-at-start") and target not in ("broker", *self.topology.processors):
                raise TopologyError(f"chaos: {fault!r}: app {original.app!r} has no processor {target!r}")
            if kind not in ("kill", "freeze", "stop", "registry-at-start", "disk-full", "oversize"):
                raise TopologyError(f"chaos: unknown fault {fault!r} "
                                    "(kill:, freeze:, stop:, registry-at-start:, disk-full:broker, oversize)")
            if kind == "disk-full":
                if target != "broker":
                    raise TopologyError(f"chaos: {fault!r}: only the broker's disk can be filled (disk-full:broker)")
                kafka_disk(stack)  # refuses a log directory on the machine's own disk
        self.services = {p.name: p for p in components.build(stack)}
        self.probe = self._new_probe()
        self.audit = Audit(self.topology, stack, f"{self.prefix}-read", lambda: self.probe)
        #: after a wait for the chain to catch up: what was short of the ends (a group's partition, by how many)
        self.behind: list[str] = []

    def _new_probe(self) -> Consumer:
        return Consumer(self.stack.kafka.config({"group.id": f"{self.prefix}-probe", "enable.auto.commit": False}))

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> Report:
        topology = self.topology
        apply(topology, self.stack)
        processors = Processors(self.path, self.stack)
        load = None
        results: list[FaultResult] = []
        try:
            processors.start()
            processors.wait_joined(timeout_s=120)
            load = _Load(self.stack, topology, self.rate, self.seed)
            load.start()
            self.rate = load.rate
            self.console.print(f"chaos on {self.app} as {self.prefix} ({'exactly-once' if self.exactly_once else 'at-least-once'}): "
                               f"{load.rate:g} events/s from {load.simulator.entities} entities; faults: {', '.join(self.faults)}")
            time.sleep(10)  # steady state first
            self.oversize = (0, 0)
            for fault in self.faults:
                started = time.monotonic()
                note, ended = self._inject(fault, processors)
                recovery = self._caught_up(ended)
                results.append(FaultResult(fault, round(started - load.started, 1), round(ended - started, 1),
                                           None if recovery is None else round(recovery, 1), note))
                self.console.print(f"  {fault:<28} lasted {ended - started:5.1f}s, recovered in "
                                   f"{'—' if recovery is None else f'{recovery:.1f}s'} {note}")
            time.sleep(5)
            load.stop()
            wait_quiet(self.probe, topology, quiet_s=5.0, timeout_s=180.0)  # windows still open stay open
            stopped = time.monotonic()
            accounting = self._account(load)
            # Quiet topics are not a settled chain: a processor stuck late in the run (ended by its watchdog and
            # started again) delivers after its restart. What is missing is counted again until it is all there
            # or the recovery timeout has passed; how long that took is in the report.
            while (not accounting.ok and accounting.acknowledged
                   and time.monotonic() - stopped < self.recovery_timeout_s):
                time.sleep(5)
                accounting = self._account(load)
            settled = round(time.monotonic() - stopped, 1)
        finally:
            if load is not None and load.is_alive():
                load.stop()
            processors.stop()
            self.probe.close()
        return Report(topology.app, self.exactly_once, self.rate, round(time.monotonic() - load.started, 1),
                      results, accounting, self.stack.kafka_brokers, topology.replication(load.source), settled)

    def close(self) -> None:
        self._folder.cleanup()

    def _account(self, load: _Load) -> Accounting:
        return self.audit.account(load.acked, load.produced, len(load.failed), self.oversize)

    # -- faults ----------------------------------------------------------------------------------
    def _inject(self, fault: str, processors: Processors) -> tuple[str, float]:
        """Inject ``fault``; returns a note and when it ended (monotonic)."""
        kind, _, target = fault.partition(":")
        if kind == "kill" and target == "broker":
            kafka, nodes = self.services["kafka"], self.stack.kafka_brokers
            os.kill(self._pid(kafka), signal.SIGKILL)
            killed = time.monotonic()
            self._wait_dead(kafka)
            note = "broker kill -9, restarted"
            if nodes > 1:  # the others serve on: the chain must catch up while this one is down
                served = self._caught_up(killed, timeout_s=self.fault_s + 30)
                note = (f"broker kill -9 (node 1 of {nodes}); with it down the chain "
                        + (f"did not catch up within the timeout (short: {', '.join(self.behind)})"
                           if served is None else f"caught up in {served:.1f} s")
                        + "; restarted")
            time.sleep(max(0.0, killed + self.fault_s - time.monotonic()))
            kafka.wait_ready(kafka.start(), self.stack.start_timeout_s)
            return note, time.monotonic()
        if kind == "kill":
            processors.kill(target)
            processors.start_one(target)
            return "", time.monotonic()
        if kind == "freeze":
            pids = self._server_pids(target)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(self.fault_s)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            return f"SIGSTOP of pid {', '.join(map(str, pids))}", time.monotonic()
        if kind == "stop":
            service = self.services[target]
            service.stop()
            time.sleep(self.fault_s)
            service.wait_ready(service.start(), self.stack.start_timeout_s)
            return "stopped, started again", time.monotonic()
        if kind == "registry-at-start":
            registry = self.services["registry"]
            registry.stop()
            processors.kill(target)
            proc = processors.start_one(target)
            time.sleep(self.fault_s)
            alive = proc.poll() is None
            registry.wait_ready(registry.start(), self.stack.start_timeout_s)
            if not alive:
                return f"{target} exited while the registry was down", time.monotonic()
            return f"{target} waited for the registry", time.monotonic()
        if kind == "disk-full":
            return self._disk_full(), time.monotonic()
        if kind == "oversize":
            return self._oversize(), time.monotonic()
        raise AssertionError(fault)

    def _disk_full(self) -> str:
        """Kafka's disk full for ``fault_s``: a file beside its log directory written until ``ENOSPC``, removed
        after; the node started again if it stopped itself meanwhile."""
        kafka = self.services["kafka"]
        filler = kafka_disk(self.stack) / "tangram-chaos-disk-full"
        chunk, written = b"\0" * (1 << 20), 0
        try:
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        written += f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                try:  # the last bytes, for a filesystem that had less than a chunk left
                    while f.write(b"\0" * 4096):
                        written += 4096
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
            full = time.monotonic()
            while time.monotonic() - full < self.fault_s:
                time.sleep(0.2)
            stopped = kafka.pid() is None
        finally:
            filler.unlink(missing_ok=True)
        nodes = f" (node 1 of {self.stack.kafka_brokers})" if self.stack.kafka_brokers > 1 else ""
        note = f"broker's disk full{nodes} for {self.fault_s:g} s ({written / (1 << 20):.0f} MiB written to fill it)"
        if not stopped:
            return note + "; it kept running"
        kafka.wait_ready(kafka.start(), self.stack.start_timeout_s)
        return note + "; it stopped itself (log directory offline), started again with the space back"

    def _oversize(self) -> str:
        """One record just under the producer's limit (its dead letter is over it), one over it (refused)."""
        source = self.topology.simulator.source
        producer = Producer(self.stack.kafka.config({"enable.idempotence": True}))
        under = 0
        for size in (999_960, 999_900, 999_800, 999_500, 999_000):
            try:
                producer.produce(source, b"x" * size, b"oversize")
                under = size
                break
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
        refused = 0
        try:
            producer.produce(source, b"x" * 1_200_000, b"oversize")
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                raise
            refused = 1
        if producer.flush(30):
            raise StackError("chaos: the oversize record was not acknowledged")
        self.oversize = (1 if under else 0, refused)
        return f"a {under}-byte record sent, a 1,200,000-byte one refused by the producer" if under else \
            "no record under the limit could be sent"

    def _server_pids(self, name: str) -> list[int]:
        """The processes that serve: Redis's server; Triton's ``tritonserver`` and its backend stubs (not
        PyTriton's wrapper, which serves nothing)."""
        pid = self._pid(self.services[name])
        if name != "triton":
            return [pid]
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")[0]
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pid and int(stat.parent.name) != pid and (
                    cmdline.endswith(b"tritonserver") or cmdline.endswith(b"triton_python_backend_stub")):
                pids.append(int(stat.parent.name))
        if not pids:
            raise StackError(f"chaos: no tritonserver process in the process group of Triton's wrapper (pid {pid})")
        return sorted(pids)

    @staticmethod
    def _pid(service: ManagedProcess) -> int:
        pid = service.pid()
        if pid is None:
            raise StackError(f"chaos: {service.name} is not running (`tangram up`)")
        return pid

    @staticmethod
    def _wait_dead(service: ManagedProcess, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while service.pid() is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    # -- recovery --------------------------------------------------------------------------------
    def _caught_up(self, since: float, timeout_s: float | None = None) -> float | None:
        """Seconds from ``since`` until every group committed past its inputs' ends at ``since`` (None: timeout,
        and ``self.behind`` says what was short: a group's partition and by how many records, or the ends
        unreadable)."""
        topology = self.topology
        deadline = time.monotonic() + (timeout_s or self.recovery_timeout_s)
        targets: dict[str, dict[TopicPartition, int]] = {}
        while time.monotonic() < deadline:
            try:
                if not targets:
                    for name, spec in topology.processors.items():
                        ends = high_watermarks(self.probe, topology, list(spec.inputs), timeout_s=5)
                        targets[name] = {tp: end for tp, end in ends.items() if end > 0}
                slack = 1 if self.exactly_once else 0  # a transaction's commit marker takes an offset
                self.behind = [f"{name} {tp.topic}[{tp.partition}] by {short}" for name, ends in targets.items()
                               for tp, short in uncommitted(self.stack, topology.group(name), ends, slack).items()]
                if not self.behind:
                    return time.monotonic() - since
            except KafkaException as exc:
                # A node is down or coming back. The probe's metadata may still name the dead node as a
                # partition's leader (a client that subscribes to nothing does not look again): a new one asks
                # the live nodes.
                self.behind = [f"ends unreadable ({exc.args[0].str()})"]
                targets = {}
                self.probe.close()
                self.probe = self._new_probe()
            time.sleep(0.5)
        return None


def print_report(report: Report, console: Console) -> None:
    faults = Table(title=f"chaos: {report.app} ({'exactly-once' if report.exactly_once else 'at-least-once'}), "
                         f"{report.rate:g} events/s for {report.duration_s:g}s"
                         + (f", {report.brokers} brokers, topics replicated x{report.replication}" if report.brokers > 1 else ""))
    for col in ("fault", "at", "lasted", "recovery", "note"):
        faults.add_column(col)
    for f in report.faults:
        faults.add_row(f.fault, f"{f.started_s:g}s", f"{f.lasted_s:g}s",
                       "not within the timeout" if f.recovery_s is None else f"{f.recovery_s:g}s", f.note)
    console.print(faults)
    a = report.accounting
    table = Table(title="every event accounted for"
                        + (f" ({report.settled_s:g}s after the topics went quiet)" if report.settled_s >= 1 else ""))
    table.add_column("what")
    table.add_column("records", justify="right")
    rows = [("produced", a.produced), ("sent (acknowledged)", a.sent), ("not acknowledged", a.refused_by_broker),
            ("oversize: sent just under the limit", a.oversize_sent),
            ("oversize: refused by the producer (over the limit)", a.oversize_refused),
            ("oversize: dead-lettered", a.oversize_dead_lettered), ("oversize: dead letter truncated", a.oversize_truncated),
            ("accepted by the first stage", a.accepted), ("duplicated there", a.duplicated), ("lost", a.lost),
            *((f"DLQ {reason}", n) for reason, n in sorted(a.dead_letters.items())),
            *((f"false dead letters {reason}", n) for reason, n in sorted(a.false_dead_letters.items())),
            ("windows expected", a.windows_expected), ("windows delivered", a.windows_delivered),
            ("windows missing", a.windows_missing), ("windows incomplete", a.windows_incomplete),
            ("windows inflated (a duplicated reading counted twice)", a.windows_inflated),
            ("windows duplicated", a.windows_duplicated), ("predictions missing", a.predictions_missing),
            ("predictions duplicated", a.predictions_duplicated)]
    for what, n in rows:
        table.add_row(what, f"{n:,}")
    console.print(table)
    console.print("[green]nothing lost[/]" if a.ok else "[red]events or windows lost (see above)[/]")
    if a.false_dead_letters:
        console.print(f"[red]{sum(a.false_dead_letters.values()):,} valid events dead-lettered[/]")
