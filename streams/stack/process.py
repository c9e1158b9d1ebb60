"""One managed process of the local stack: start, readiness, pid file, stop.

Every component (Kafka, the schema registry, Redis, Triton) is a :class:`ManagedProcess`:
it runs in its own session (so its whole process group can be stopped), writes stdout and
stderr to one log file and records its pid in a pid file. A pid file whose process is gone,
or now belongs to another program, is stale and is ignored and removed.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from streams.errors import StackError

log = logging.getLogger("tangram.stack")


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on ``host:port``.

    Binds with SO_REUSEADDR, as the servers do, so sockets in TIME_WAIT after a stop do not count.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise StackError(f"cannot check port {host}:{port}: {exc}") from exc
    return False


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 40, offset: int = 0) -> str:
    """The last ``lines`` lines of a log file, reading from byte ``offset`` on."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a child of ours is reaped on the way)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # our own child, just reaped
    except ChildProcessError:
        pass  # not our child: its parent (or init) reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """True when ``pid`` is gone or a zombie whose threads are all gone.

    A JVM's main thread may exit while its shutdown hooks still run in other threads; the
    process then shows state Z but is still alive.
    """
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def _group_alive(pgid: int) -> bool:
    """True while any process of the process group ``pgid`` is left (zombies excepted)."""
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgrp = int(stat_path.read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, IndexError, ValueError):
            continue
        if pgrp == pgid and not _zombie(int(stat_path.parent.name)):
            return True
    return False


@dataclass
class ManagedProcess:
    """A long-running server of the stack, described by how to start it and how to probe it.

    ``marker`` is a piece of the command line that identifies the program in
    ``/proc/<pid>/cmdline``, so that a recycled pid is not taken for our server.
    ``prepare`` runs before a start: it checks prerequisites (raising :class:`StackError`
    with the next step to take) and does first-time setup such as formatting storage.
    ``after_ready`` runs once a server this call started answers, for setup that needs it
    running (the secured Kafka's principals for the components started after it).
    ``component`` is the stack component it belongs to (``kafka`` for every node of a
    multi-node Kafka; by default its name): the unit that ``up``, ``down`` and ``--only``
    select, and that ``up`` starts as a whole before waiting for it.
    """

    name: str
    argv: Callable[[], Sequence[str]]
    marker: str
    host: str
    ports: Mapping[str, int]
    address: str
    probe: Callable[[], bool]
    log_path: Path
    pid_path: Path
    cwd: Path | None = None
    env: Callable[[], Mapping[str, str]] | None = None
    prepare: Callable[[], None] | None = None
    after_ready: Callable[[], None] | None = None
    stop_timeout_s: float = 15.0
    component: str = ""
    _log_offset: int = 0

    def __post_init__(self) -> None:
        self.component = self.component or self.name

    # -- state --------------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The pid of our running server, or None (a stale pid file is removed)."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if _alive(pid) and self._is_ours(pid):
            return pid
        log.debug("%s: removing stale pid file %s (pid %s)", self.name, self.pid_path, pid)
        self.pid_path.unlink(missing_ok=True)
        return None

    def _is_ours(self, pid: int) -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return self.marker in cmdline

    def ready(self) -> bool:
        """True when the server answers its readiness probe."""
        try:
            return bool(self.probe())
        except Exception as exc:  # noqa: BLE001 - a probe failing for any reason means "not ready"
            log.debug("%s: probe failed: %s", self.name, exc)
            return False

    def busy_ports(self) -> list[str]:
        """Descriptions of this component's ports that something else already listens on."""
        return [
            f"{self.host}:{port} ({self.name} {role})"
            for role, port in self.ports.items()
            if port_in_use(self.host, port)
        ]

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> int:
        """Start the server in its own session, appending to its log; returns the pid."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env() if self.env else {})}
        with self.log_path.open("ab") as logf:
            self._log_offset = logf.tell()
            logf.write(f"\n==== tangram: starting {self.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                       f"{' '.join(argv)}\n".encode())
            logf.flush()
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    cwd=self.cwd, env=env, start_new_session=True,
                )
            except OSError as exc:
                raise StackError(f"{self.name}: cannot run {argv[0]}: {exc}") from exc
        self.pid_path.write_text(f"{proc.pid}\n")
        log.info("%s: started, pid %d, log %s", self.name, proc.pid, self.log_path)
        return proc.pid

    def wait_ready(self, pid: int, timeout_s: float) -> float:
        """Wait until the probe answers; returns the seconds it took.

        Raises :class:`StackError`, with the tail of the log, when the process exits or the
        timeout passes first.
        """
        started = time.monotonic()
        while True:
            if self.ready():
                return time.monotonic() - started
            if not _alive(pid):
                raise StackError(f"{self.name} exited during startup; last lines of {self.log_path}:\n"
                                 f"{self.log_tail()}")
            if time.monotonic() - started > timeout_s:
                raise StackError(f"{self.name} was not ready within {timeout_s:.0f} s; last lines of "
                                 f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        """The end of this component's log, from its latest start on."""
        return tail(self.log_path, lines, self._log_offset)

    def stop(self) -> bool:
        """SIGTERM the server, then its process group; after ``stop_timeout_s`` SIGKILL the group.

        Returns True when a running server was stopped; the pid file is removed either way.
        """
        pid = self.pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return False
        log.info("%s: stopping pid %d", self.name, pid)
        # SIGTERM the server alone first: it stops its own children in order (Triton's
        # wrapper stops tritonserver and the backend stubs); then whatever is left of its group.
        self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _alive(pid) and _group_alive(pid):
            self._signal_group(pid, signal.SIGTERM)
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        if _alive(pid) or _group_alive(pid):
            log.warning("%s: still running after %.0f s, sending SIGKILL", self.name, self.stop_timeout_s)
            self._signal_group(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        self.pid_path.unlink(missing_ok=True)
        return True

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    @classmethod
    def _signal_group(cls, pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            cls._signal(pid, sig)
