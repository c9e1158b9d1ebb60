"""Run a topology's processors as child processes, one per replica, as containers would run them.

Used by ``tangram demo`` and ``tangram verify``: start, wait until every member
has joined its consumer group with partitions, kill (for chaos), restart, stop.
Each process logs to ``<TANGRAM_HOME>/logs/processor-<name>[-<replica>].log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from streams import PROJECT_ROOT
from streams.errors import StackError
from streams.settings import StackSettings
from streams.topology import Topology, load_topology


class Processors:
    """The processes of one topology's processors (context manager: stops them all on exit)."""

    def __init__(self, topology_path: Path, stack: StackSettings, names: list[str] | None = None):
        self.topology_path = Path(topology_path)
        self.topology = load_topology(self.topology_path)
        self.stack = stack
        self.names = names or list(self.topology.processors)
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})

    def __enter__(self) -> "Processors":
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every replica of every processor."""
        for name in self.names:
            for replica in range(self.topology.processors[name].replicas):
                self.start_one(name, replica)

    def start_one(self, name: str, replica: int = 0) -> subprocess.Popen:
        self.stack.logs_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"-{replica}" if self.topology.processors[name].replicas > 1 else ""
        log = (self.stack.logs_dir / f"processor-{name}{suffix}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.update({f"TANGRAM_{k.upper()}": str(v) for k, v in self.stack.model_dump().items() if v is not None})
        proc = subprocess.Popen([sys.executable, "-m", "streams", "run", str(self.topology_path), name],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=PROJECT_ROOT, start_new_session=True)
        self.procs[(name, replica)] = proc
        return proc

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
        """Signal one replica's process group (SIGKILL: no flush, no commit) and reap it."""
        proc = self.procs[(name, replica)]
        os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process (each finishes its batch and commits), SIGKILL what is left after the timeout."""
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


def high_watermarks(consumer: Consumer, topology: Topology, topics: list[str] | None = None) -> dict[TopicPartition, int]:
    """End offset of every partition of ``topics`` (default: all of the topology's)."""
    out = {}
    for topic in topics or list(topology.topics):
        for p in range(topology.partitions(topic)):
            out[TopicPartition(topic, p)] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
    return out


def wait_quiet(consumer: Consumer, topology: Topology, quiet_s: float = 3.0, timeout_s: float = 30.0) -> None:
    """Wait until no topic of the topology grows for ``quiet_s``: every processor has caught up."""
    deadline = time.monotonic() + timeout_s
    last, since = sum(high_watermarks(consumer, topology).values()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(high_watermarks(consumer, topology).values())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
