"""The local stack, started and stopped by the project itself (no Docker).

``up`` starts Kafka (KRaft), the schema registry, Redis and Triton on ``settings.host`` in
dependency order and waits until each answers; ``down`` stops them in reverse order;
``status`` shows them. State, logs and pid files live under ``settings.home``
(``TANGRAM_HOME``), so a test stack can run beside a developer's on other ports.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table

from streams.errors import StackError
from streams.settings import StackSettings
from streams.stack import components, kafka
from streams.stack.process import ManagedProcess

__all__ = ["up", "down", "status", "fetch_jars", "NAMES"]

log = logging.getLogger("tangram.stack")
NAMES = components.NAMES
_console = Console()
_stderr = Console(stderr=True)


def _select(settings: StackSettings, only: Sequence[str] | None) -> list[ManagedProcess]:
    procs = components.build(settings)
    if only is None:
        return procs
    unknown = set(only) - set(NAMES)
    if unknown:
        raise StackError(f"unknown stack components {sorted(unknown)}; known: {', '.join(NAMES)}")
    return [p for p in procs if p.component in only]


def fetch_jars(settings: StackSettings) -> None:
    """Resolve the Kafka jars with Maven (cached in ~/.m2) into ``<home>/kafka/libs``."""
    kafka.fetch_jars(settings)


def up(settings: StackSettings, only: Sequence[str] | None = None) -> None:
    """Start every component that is not running yet, in dependency order, and wait for it.

    Idempotent: running components are left alone. Prerequisites and ports of the missing
    components are checked before anything starts. When a component fails to start, the
    components started by this call are stopped again, the tail of its log is printed and
    :class:`StackError` is raised.
    """
    procs = _select(settings, only)
    running = {p.name: p.pid() for p in procs}
    missing = [p for p in procs if running[p.name] is None]
    for p in procs:
        if running[p.name] is not None:
            log.info("%s: already running (pid %d)", p.name, running[p.name])
    busy = [port for p in missing for port in p.busy_ports()]
    if busy:
        raise StackError(f"port already in use by another process: {', '.join(busy)}; stop that process "
                         "or move the stack to other ports (TANGRAM_*_PORT)")
    for p in missing:
        if p.prepare is not None:
            p.prepare()

    started: list[ManagedProcess] = []
    # A component's processes start together, then are waited for: the nodes of a multi-node Kafka
    # elect their controller among themselves, so none is ready before a majority runs.
    for _, members in itertools.groupby(procs, key=lambda p: p.component):
        members = list(members)
        t0 = time.monotonic()
        fresh = [p for p in members if running[p.name] is None]
        for p in fresh:
            running[p.name] = p.start()
            started.append(p)
        for p in members:  # one started earlier may still be starting: its dependents wait for it too
            try:
                p.wait_ready(running[p.name], settings.start_timeout_s)  # type: ignore[arg-type]
            except StackError as exc:
                _stderr.print(f"[red]{p.name} failed to start[/red]; last lines of {p.log_path}:")
                _stderr.print(p.log_tail(), markup=False, highlight=False)
                for q in reversed(started):
                    q.stop()
                raise StackError(str(exc)) from None
        for p in fresh:
            if p.after_ready is not None:
                p.after_ready()
            log.info("%s: ready in %.1f s", p.name, time.monotonic() - t0)
    _print_table(procs)


def down(settings: StackSettings, only: Sequence[str] | None = None) -> None:
    """Stop the components in reverse dependency order (SIGTERM, then SIGKILL); data stays.

    Kafka's nodes stop together, last: a node stopped after the others has lost the controller quorum that
    approves its controlled shutdown, and would wait out its stop timeout before being killed.
    """
    procs = list(reversed(_select(settings, only)))
    nodes = [p for p in procs if p.component == "kafka"]
    for p in procs:
        if p.component != "kafka" and not p.stop():
            log.info("%s: not running", p.name)
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        for p, stopped in zip(nodes, pool.map(ManagedProcess.stop, nodes)):
            if not stopped:
                log.info("%s: not running", p.name)


def status(settings: StackSettings, only: Sequence[str] | None = None) -> bool:
    """Print a table of the components, and the processors the launcher runs; True iff every component is ready."""
    ready = _print_table(_select(settings, only))
    _print_processors(settings)
    return ready


def _print_processors(settings: StackSettings) -> None:
    """The processors started by ``streams.launcher`` (demo, verify, tests) and their metrics endpoints."""
    import json

    for path in sorted((settings.home / "processors").glob("*.json")):
        try:
            listing = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        table = Table(title=f"processors of {listing.get('app')} ({listing.get('topology')})",
                      caption="`tangram status --topology FILE` for rates, lag, p99, drift", caption_justify="left")
        for col in ("processor", "replica", "pid", "metrics"):
            table.add_column(col)
        for e in listing.get("processors", []):
            table.add_row(e["name"], str(e["replica"]), str(e["pid"]), e.get("metrics_url") or "-")
        _console.print(table)


def _print_table(procs: Sequence[ManagedProcess]) -> bool:
    logs_dir = procs[0].log_path.parent if procs else None
    table = Table(title="Tangram local stack", caption=f"logs in {logs_dir}", caption_justify="left")
    for col in ("component", "pid", "address", "state", "log"):
        table.add_column(col, no_wrap=col != "address", overflow="fold")
    all_ready = True
    for p in procs:
        pid = p.pid()
        ready = pid is not None and p.ready()
        all_ready &= ready
        state = "[green]ready[/green]" if ready else ("[yellow]not ready[/yellow]" if pid else "[red]stopped[/red]")
        table.add_row(p.name, str(pid or "-"), p.address, state, p.log_path.name)
    _console.print(table)
    return all_ready
