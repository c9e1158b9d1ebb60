"""Processes that end and start again: the launcher starts again a replica that exits by itself (as compose's
`restart: unless-stopped` and Kubernetes do), with a growing back-off, and leaves down one that `kill` or `stop`
ended; the delivery loop's watchdog ends a process stuck in a client call, so that the restart recovers it."""

from __future__ import annotations

import subprocess
import sys
import time

from reference import PM_TOPOLOGY

from streams.launcher import LauncherSettings, Processors
from streams.settings import StackSettings


def launcher(tmp_path, monkeypatch, script: str) -> tuple[Processors, list[subprocess.Popen]]:
    """Processors whose replicas run ``script`` (a stand-in for `tangram run`), and every process they started."""
    procs = Processors(PM_TOPOLOGY, StackSettings(home=tmp_path), names=["ingest"],
                       settings=LauncherSettings(restart_backoff_s=0.1, metrics_base_port=0))
    spawned: list[subprocess.Popen] = []

    def spawn(name: str, replica: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        procs.procs[(name, replica)] = proc
        procs._started[(name, replica)] = time.monotonic()
        spawned.append(proc)
        return proc

    monkeypatch.setattr(procs, "_spawn", spawn)
    return procs, spawned


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_replica_that_exits_by_itself_is_started_again_with_a_growing_back_off(tmp_path, monkeypatch):
    procs, spawned = launcher(tmp_path, monkeypatch, "import sys; sys.exit(3)")
    try:
        procs.start_one("ingest")
        wait_for(lambda: len(spawned) >= 4)
        assert procs.restarts[("ingest", 0)] >= 3
        assert all(p.wait(5) == 3 for p in spawned[:3])
    finally:
        procs.stop()
    after = len(spawned)
    time.sleep(1.0)
    assert len(spawned) == after  # stopped: nothing starts again


def test_a_killed_replica_stays_down_until_started_again(tmp_path, monkeypatch):
    procs, spawned = launcher(tmp_path, monkeypatch, "import time; time.sleep(60)")
    try:
        procs.start_one("ingest")
        procs.kill("ingest")
        time.sleep(1.0)
        assert len(spawned) == 1 and procs.restarts == {}
        procs.start_one("ingest")  # as the chaos campaign restarts what it killed
        assert len(spawned) == 2 and spawned[1].poll() is None
    finally:
        procs.stop()
    assert all(p.poll() is not None for p in spawned)


def test_the_delivery_watchdog_ends_a_process_stuck_past_its_deadline(tmp_path):
    """A transactional call that never returns (librdkafka 5456, 5511) ends the process, which the launcher
    then starts again; within the deadline nothing happens."""
    script = (
        "import logging, time\n"
        "from streams.delivery import Watchdog\n"
        "logging.basicConfig()\n"
        "w = Watchdog('stuck')\n"
        "with Watchdog.deadline(w, 0.5, 'a quick call'):\n"
        "    time.sleep(0.1)\n"
        "print('survived the quick call', flush=True)\n"
        "with Watchdog.deadline(w, 0.5, 'committing a transaction'):\n"
        "    time.sleep(30)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert result.returncode == 75
    assert "survived the quick call" in result.stdout
    assert "stuck committing a transaction past its deadline" in result.stderr
