"""The local stack itself: starts from nothing, stops cleanly, is idempotent, explains busy ports.

Real processes, no mocks. The tests that start a stack of their own use free ports and a
temporary home, so they run beside the session stack and beside a developer's.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from confluent_kafka.admin import AdminClient

from streams.errors import StackError
from streams.settings import StackSettings
from streams.stack import NAMES, down, status, up
from streams.stack.components import build
from streams.stack.process import port_in_use

pytestmark = pytest.mark.integration


PORT_FIELDS = [name for name in StackSettings.model_fields if name.endswith("_port")]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _own_settings(home: Path) -> StackSettings:
    """Settings of a second stack: its own home, free ports."""
    return StackSettings(home=home, **dict(zip(PORT_FIELDS, _free_ports(len(PORT_FIELDS)), strict=True)))


def _pids(settings: StackSettings) -> dict[str, int | None]:
    return {p.name: p.pid() for p in build(settings)}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _all_ports(settings: StackSettings, only: list[str]) -> list[int]:
    return [port for p in build(settings) if p.name in only for port in p.ports.values()]


def test_stack_starts_from_nothing_and_stops_cleanly(tmp_path: Path, components: list[str]) -> None:
    settings = _own_settings(tmp_path / "home")
    only = components
    t0 = time.monotonic()
    try:
        up(settings, only=only)
        started = time.monotonic() - t0
        pids = _pids(settings)
        assert all(pids[name] for name in only), pids
        assert status(settings, only=only)
        assert {p.name: p.log_path.is_file() for p in build(settings) if p.name in only} == {n: True for n in only}
        print(f"stack of {only} up from nothing in {started:.1f} s")
    finally:
        down(settings, only=only)
    for name in only:
        pid = pids[name]
        assert pid is not None
        assert not Path(f"/proc/{pid}/cmdline").exists() or not Path(f"/proc/{pid}/cmdline").read_bytes(), \
            f"{name} (pid {pid}) still runs after down"
    assert not list((settings.home / "run").glob("*.pid"))
    busy = [port for port in _all_ports(settings, only) if port_in_use(settings.host, port)]
    assert busy == [], f"ports still in use after down: {busy}"
    assert not status(settings, only=only)


def test_up_twice_is_idempotent(stack: StackSettings, components: list[str]) -> None:
    only = components
    before = _pids(stack)
    t0 = time.monotonic()
    up(stack, only=only)
    assert time.monotonic() - t0 < 10, "a second `up` must not restart anything"
    assert _pids(stack) == before
    assert status(stack, only=only)


def test_session_stack_answers(stack: StackSettings, components: list[str]) -> None:
    only = components
    if "kafka" in only:
        AdminClient({"bootstrap.servers": stack.bootstrap_servers}).list_topics(timeout=10)
    if "redis" in only:
        assert redis.Redis.from_url(stack.redis_url).ping()
    if "registry" in only:
        with urllib.request.urlopen(f"{stack.registry_url}/subjects", timeout=5) as resp:
            assert resp.status == 200
            assert isinstance(json.load(resp), list)
    if "triton" in only:
        with urllib.request.urlopen(f"http://{stack.triton_http_url}/v2/health/ready", timeout=5) as resp:
            assert resp.status == 200


def test_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    settings = _own_settings(tmp_path / "home")
    with socket.socket() as squatter:
        squatter.bind((settings.host, settings.kafka_port))
        squatter.listen()
        with pytest.raises(StackError, match=rf"{settings.host}:{settings.kafka_port} \(kafka broker\)") as err:
            up(settings, only=["kafka", "redis"])
    assert "already in use" in str(err.value)
    assert _pids(settings) == {name: None for name in NAMES}, "nothing may start when a port is taken"


def test_stale_pid_file_is_ignored(tmp_path: Path) -> None:
    settings = _own_settings(tmp_path / "home")
    run = settings.home / "run"
    run.mkdir(parents=True)
    (run / "redis.pid").write_text(f"{_dead_pid()}\n")
    assert not status(settings, only=["redis"])
    assert not (run / "redis.pid").exists(), "a stale pid file is removed"
    (run / "redis.pid").write_text(f"{_dead_pid()}\n")
    try:
        up(settings, only=["redis"])
        assert _pids(settings)["redis"] is not None
        assert redis.Redis(host=settings.host, port=settings.redis_port).ping()
    finally:
        down(settings, only=["redis"])
    assert not port_in_use(settings.host, settings.redis_port)


def test_component_dying_at_startup_stops_what_up_started(tmp_path: Path) -> None:
    settings = _own_settings(tmp_path / "home").model_copy(update={"app_python": Path("/bin/false")})
    with pytest.raises(StackError, match="registry exited during startup") as err:
        up(settings, only=["kafka", "registry"])
    assert str(settings.logs_dir / "registry.log") in str(err.value)
    assert _pids(settings) == {name: None for name in NAMES}, "kafka, started by this `up`, is stopped again"
    assert not port_in_use(settings.host, settings.kafka_port)
