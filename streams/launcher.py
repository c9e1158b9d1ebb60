"""Run a topology's processors as child processes, one per replica, as containers would run them.

Used by ``tangram demo`` and ``tangram verify``: start, wait until every member
has joined its consumer group with partitions, kill (for chaos), restart, stop.
Each process logs to ``<TANGRAM_HOME>/logs/processor-<name>[-<replica>].log``.

Every replica serves Prometheus metrics (``tangram run --metrics-port``) on its own port:
``TANGRAM_METRICS_BASE_PORT`` (default 9100) plus its position among the topology's replicas,
or the next free port when that one is taken (another topology, another test session). The
endpoints in use are written to ``<TANGRAM_HOME>/processors/<app>.json``, where ``tangram
status --topology`` and ``Processors.endpoints`` find them.

A replica that exits by itself (an error it does not survive: an exactly-once transaction it could not
finish, a lost fencing) is started again, as compose's ``restart: unless-stopped`` and Kubernetes do,
after a back-off of 1 s doubling to 30 s while it keeps failing; one that ``kill`` or ``stop`` ended is
not. Each replica runs as ``TANGRAM_REPLICA=<n>``: its exactly-once transactional id is stable across
restarts (``streams.delivery.RunnerConfig.replica``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from streams.errors import StackError
from streams.security.local import processor_env
from streams.settings import StackSettings
from streams.topology import Topology, load_topology

log = logging.getLogger("tangram.launcher")


class LauncherSettings(BaseSettings):
    """Where the launched processors serve their metrics (``TANGRAM_METRICS_BASE_PORT``)."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_", frozen=True, extra="ignore")

    metrics_base_port: int = Field(9100, ge=0, le=65_000,
                                   description="First metrics port; each replica takes the next free one. 0: no metrics.")
    metrics_port_span: int = Field(200, ge=1, description="How far above the base port a free port is looked for.")
    restart_backoff_s: float = Field(1.0, ge=0, description="Wait before starting again a replica that exited by "
                                                            "itself; doubles while it keeps exiting, up to 30 s.")


def port_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def endpoints_file(stack: StackSettings, app: str) -> Path:
    """Where the launcher lists the running processors of ``app`` and their metrics endpoints."""
    return stack.home / "processors" / f"{app}.json"


def read_endpoints(stack: StackSettings, app: str) -> list[dict]:
    """The processors of ``app`` the launcher started (name, replica, pid, metrics_url), if any."""
    try:
        return json.loads(endpoints_file(stack, app).read_text())["processors"]
    except (OSError, ValueError, KeyError):
        return []


class Processors:
    """The processes of one topology's processors (context manager: stops them all on exit)."""

    def __init__(self, topology_path: Path, stack: StackSettings, names: list[str] | None = None,
                 settings: LauncherSettings | None = None):
        self.topology_path = Path(topology_path)
        self.topology = load_topology(self.topology_path)
        self.stack = stack
        self.settings = settings or LauncherSettings()
        self.names = names or list(self.topology.processors)
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.ports: dict[tuple[str, int], int] = {}
        self.admin = AdminClient(stack.kafka.config())
        #: replicas started again after they exited by themselves, how many times
        self.restarts: dict[tuple[str, int], int] = {}
        self._ended: set[tuple[str, int]] = set()  # ended by kill/stop: not started again by the supervisor
        self._started: dict[tuple[str, int], float] = {}  # when each replica's process was started (monotonic)
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def __enter__(self) -> "Processors":
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every replica of every processor, and the supervisor that restarts one that exits by itself."""
        for name in self.names:
            for replica in range(self.topology.processors[name].replicas):
                self.start_one(name, replica)

    def start_one(self, name: str, replica: int = 0) -> subprocess.Popen:
        with self._lock:
            self._ended.discard((name, replica))
            proc = self._spawn(name, replica)
        if self._supervisor is None:
            self._stopping.clear()
            self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="processor-supervisor")
            self._supervisor.start()
        return proc

    def _supervise(self) -> None:
        """Start again, after a growing back-off, each replica that exited without ``kill`` or ``stop``."""
        backoff: dict[tuple[str, int], float] = {}
        due: dict[tuple[str, int], tuple[subprocess.Popen, float]] = {}  # the exited process, when to replace it
        while not self._stopping.wait(0.2):
            with self._lock:
                now = time.monotonic()
                for slot, proc in list(self.procs.items()):
                    if slot in self._ended:
                        continue
                    if proc.poll() is None:
                        if now - self._started[slot] > 60:
                            backoff.pop(slot, None)  # up for a minute: the next failure starts the back-off over
                        continue
                    if slot not in due or due[slot][0] is not proc:
                        wait = backoff[slot] = min(30.0, backoff.get(slot, self.settings.restart_backoff_s / 2) * 2)
                        due[slot] = (proc, now + wait)
                        log.warning("processor %s (replica %d) exited with %s; starting it again in %.0f s",
                                    *slot, proc.returncode, wait)
                    elif now >= due[slot][1]:
                        self.restarts[slot] = self.restarts.get(slot, 0) + 1
                        self._spawn(*slot)

    def _spawn(self, name: str, replica: int) -> subprocess.Popen:
        self.stack.logs_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"-{replica}" if self.topology.processors[name].replicas > 1 else ""
        log = (self.stack.logs_dir / f"processor-{name}{suffix}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.stack.environ()}
        env.update(processor_env(self.stack, self.topology, name))  # its own principal on a secured stack
        env["TANGRAM_REPLICA"] = str(replica)
        command = [sys.executable, "-m", "streams", "run", str(self.topology_path), name]
        port = self._metrics_port(name, replica)
        if port:
            command += ["--metrics-port", str(port)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[(name, replica)] = proc
        self._started[(name, replica)] = time.monotonic()
        self._write_endpoints()
        return proc

    def _metrics_port(self, name: str, replica: int) -> int | None:
        """This replica's port: kept across restarts, else base + its position, else the next free one."""
        if not self.settings.metrics_base_port:
            return None
        if (name, replica) in self.ports:
            return self.ports[(name, replica)]
        slots = [(n, r) for n, spec in self.topology.processors.items() for r in range(spec.replicas)]
        base = self.settings.metrics_base_port
        taken = set(self.ports.values())
        candidates = [base + slots.index((name, replica)),
                      *range(base, base + self.settings.metrics_port_span)]
        for port in candidates:
            if port not in taken and port_free(self.stack.host, port):
                self.ports[(name, replica)] = port
                return port
        raise StackError(f"no free metrics port in {base}..{base + self.settings.metrics_port_span - 1} on "
                         f"{self.stack.host}; set TANGRAM_METRICS_BASE_PORT")

    def endpoints(self) -> list[dict]:
        """The running replicas: name, replica, pid and ``/metrics`` URL (None without metrics)."""
        return [
            {"name": name, "replica": replica, "pid": proc.pid,
             "metrics_url": f"http://{self.stack.host}:{self.ports[(name, replica)]}/metrics"
             if (name, replica) in self.ports else None}
            for (name, replica), proc in sorted(self.procs.items())
        ]

    def _write_endpoints(self) -> None:
        path = endpoints_file(self.stack, self.topology.app)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.procs:
            path.write_text(json.dumps({"app": self.topology.app, "topology": str(self.topology_path.resolve()),
                                        "processors": self.endpoints()}, indent=2) + "\n")
        else:
            path.unlink(missing_ok=True)

    def wait_joined(self, timeout_s: float = 90.0, names: list[str] | None = None) -> float:
        """Wait until each processor's group has all its members with partitions; returns seconds waited."""
        names = names or self.names
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            for (name, replica), proc in self.procs.items():
                if proc.poll() is not None:
                    raise StackError(f"processor {name} (replica {replica}) exited with {proc.returncode} while starting; "
                                     f"see {self.stack.logs_dir}/processor-{name}*.log")
            if all(self._joined(name) for name in names):
                return time.monotonic() - started
            time.sleep(0.3)
        raise StackError(f"processors did not join their consumer groups within {timeout_s:.0f}s")

    def _joined(self, name: str) -> bool:
        group = self.topology.group(name)
        try:
            g = self.admin.describe_consumer_groups([group])[group].result(timeout=5)
        except KafkaException:
            return False
        want = min(self.topology.processors[name].replicas,
                   min(self.topology.partitions(t) for t in self.topology.processors[name].inputs))
        members = [m for m in g.members if m.assignment.topic_partitions]
        return len(members) >= want and g.state.name == "STABLE"

    def kill(self, name: str, replica: int = 0, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal one replica's process group (SIGKILL: no flush, no commit) and reap it; it stays down until
        :meth:`start_one`."""
        with self._lock:
            self._ended.add((name, replica))
            proc = self.procs[(name, replica)]
        os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process (each finishes its batch and commits), SIGKILL what is left after the timeout."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
            self._supervisor = None
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        self._write_endpoints()


def high_watermarks(consumer: Consumer, topology: Topology, topics: list[str] | None = None,
                    timeout_s: float = 10.0) -> dict[TopicPartition, int]:
    """End offset of every partition of ``topics`` (default: all of the topology's)."""
    out = {}
    for topic in topics or list(topology.topics):
        for p in range(topology.partitions(topic)):
            out[TopicPartition(topic, p)] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)[1]
    return out


def uncommitted(settings: StackSettings, group: str, ends: dict[TopicPartition, int],
                slack: int = 0) -> dict[TopicPartition, int]:
    """The partitions ``group`` has not committed up to ``ends`` (less ``slack``: exactly-once, the commit marker
    after a transaction's last record is an offset no group commits), with how many records it is short."""
    if not ends:
        return {}
    consumer = Consumer(settings.kafka.config({"group.id": group, "enable.auto.commit": False}))
    try:
        committed = consumer.committed(list(ends), timeout=10)
    finally:
        consumer.close()
    short = {}
    for tp in committed:
        key = TopicPartition(tp.topic, tp.partition)
        end = ends[key]
        if tp.offset < end - slack:
            short[key] = end - max(tp.offset, 0)
    return short


def quiet_period_s(topology: Topology, floor_s: float = 3.0) -> float:
    """How long the topics may stay still while a processor is still busy: its longest declared call deadline.

    A processor whose micro-batch waits on a slow service (OCR on a CPU Triton: seconds a batch)
    produces nothing until the call returns, and the topology declares how long that may take.
    """
    deadlines = [call.timeout_ms / 1000 for spec in topology.processors.values() for call in spec.calls]
    return max([floor_s, *deadlines])


def wait_quiet(consumer: Consumer, topology: Topology, quiet_s: float | None = None, timeout_s: float = 30.0) -> None:
    """Wait until no topic of the topology grows for ``quiet_s`` (default: :func:`quiet_period_s`): every
    processor has caught up."""
    quiet_s = quiet_period_s(topology) if quiet_s is None else quiet_s
    deadline = time.monotonic() + timeout_s
    last, since = sum(high_watermarks(consumer, topology).values()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(high_watermarks(consumer, topology).values())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
