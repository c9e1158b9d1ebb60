"""A private local Triton for the tests that stop it, freeze it or serve their own model versions.

The session stack's Triton serves the checked-in repository (``anomaly`` version 1); tests that need
other versions, or a Triton they may kill, start a :class:`TritonProcess` on its own ports (shifted
by ``TANGRAM_TEST_PORT_OFFSET`` like the stack's) and point processors at it with :func:`own_triton`.
One runs at a time: each module's fixture stops it when the module ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from reference import REPO as PROJECT_ROOT
from streams.settings import StackSettings
from streams.stack.components import TRITON_SERVER

HOST = "127.0.0.1"
_OFFSET = int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
HTTP_PORT, GRPC_PORT, METRICS_PORT = 28010 + _OFFSET, 28011 + _OFFSET, 28012 + _OFFSET
REPOSITORY = PROJECT_ROOT / "topologies" / "predictive_maintenance" / "model_repository"
START_TIMEOUT_S = 120.0


class TritonProcess:
    """A private local Triton that a test may stop, restart, freeze (SIGSTOP) and thaw."""

    def __init__(self, repository: Path, log: Path):
        self.repository = repository
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{HTTP_PORT}/v2/health/ready", timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def start(self, tries: int = 3) -> float:
        """Start and wait until ready. A start whose tritonserver dies while loading the models (exit
        code in the log) is retried, up to ``tries`` starts in all."""
        started = time.monotonic()
        for attempt in range(1, tries + 1):
            if self._start_once():
                return time.monotonic() - started
            print(f"\nprivate Triton died while starting (start {attempt}/{tries}), retrying")
            time.sleep(2.0)  # let the dead one's children release the ports
        pytest.fail(f"Triton did not start in {tries} tries:\n{self.log.read_text()[-3000:]}")

    def _start_once(self) -> bool:
        started = time.monotonic()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(StackSettings().triton_python), str(TRITON_SERVER),
                 "--model-repository", str(self.repository), "--host", HOST, "--http-port", str(HTTP_PORT),
                 "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)],
                cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while not self.ready():
            if self.process.poll() is not None:
                return False
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"Triton not ready within {START_TIMEOUT_S:.0f}s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.thaw()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def _servers(self) -> list[int]:
        assert self.process is not None
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    if int(stat[stat.rfind(")") + 2:].split()[3]) == self.process.pid and \
                            (entry / "exe").resolve().name == "tritonserver":
                        pids.append(int(entry.name))
                except (OSError, ValueError):
                    continue
        return pids

    def freeze(self) -> None:
        """SIGSTOP the tritonserver process: connections stay open, nothing answers."""
        servers = self._servers()
        assert servers, "no tritonserver process to freeze"
        for pid in servers:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._servers():
            os.kill(pid, signal.SIGCONT)


def own_triton(stack: StackSettings) -> StackSettings:
    """``stack`` with its Triton address replaced by the private one's."""
    return stack.model_copy(update={"triton_http_port": HTTP_PORT, "triton_grpc_port": GRPC_PORT,
                                    "triton_metrics_port": METRICS_PORT})
