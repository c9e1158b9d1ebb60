"""``tangram config …``: set, get, delete, history, diff, snapshot, restore."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from streams.config_center.center import CONFIG_TOPIC, ConfigCenter
from streams.config_center.state import AppliedChange, ConfigOp, DiffLine, Scope
from streams.errors import ConfigCenterError
from streams.settings import StackSettings

config_app = typer.Typer(help="Config center: versioned, validated config on the compacted topic _tangram.config.",
                         no_args_is_help=True)
_console = Console()

TopicOpt = typer.Option(CONFIG_TOPIC, "--topic", help="The config topic.")
AuthorOpt = typer.Option(None, "--author", help="Who makes the change (default: the OS user).")
ReasonOpt = typer.Option("", "--reason", "-m", help="Why: recorded with the change.")
PrefixOpt = typer.Option(None, "--prefix", help="Scope: only entities whose key starts with this.")
ShareOpt = typer.Option(None, "--share", help="Scope: this stable hash share of entities (0..1].")


def _center(topic: str) -> ConfigCenter:
    return ConfigCenter(StackSettings().kafka, topic)


def _scope(prefix: Optional[str], share: Optional[float]) -> Scope | None:
    if prefix is None and share is None:
        return None
    try:
        return Scope(prefix=prefix, share=share)
    except ValueError as exc:
        raise ConfigCenterError(f"invalid scope: {exc}") from None


def _value(text: str) -> Any:
    """JSON if it parses (true, 200, {"a": 1}), else the text itself; @file reads a JSON file."""
    if text.startswith("@"):
        return json.loads(Path(text[1:]).read_text())
    try:
        return json.loads(text)
    except ValueError:
        return text


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _print_applied(applied: AppliedChange) -> None:
    c = applied.change
    _console.print(f"config [bold]v{applied.version}[/] by {c.author} at {_when(c.at_ms)}"
                   + (f" ({c.reason})" if c.reason else ""))
    _print_diff(applied.diff)


def _print_diff(lines: list[DiffLine]) -> None:
    if not lines:
        _console.print("  (no differences)")
    for line in lines:
        _console.print("  " + line.text(), markup=False, highlight=False)


@config_app.command("set")
def set_(
    namespace: str = typer.Argument(..., help="model-config, feature-switch, business-rule, monitor-threshold."),
    key: str = typer.Argument(...),
    value: str = typer.Argument(..., help="JSON (true, 200, {...}) or text; @file.json reads a file."),
    prefix: Optional[str] = PrefixOpt, share: Optional[float] = ShareOpt,
    topic: str = TopicOpt, author: Optional[str] = AuthorOpt, reason: str = ReasonOpt,
) -> None:
    """Set one value (validated against its namespace's schema before it is published)."""
    _print_applied(_center(topic).set(namespace, key, _value(value), author, reason, _scope(prefix, share)))


@config_app.command("apply")
def apply_ops(
    ops_file: Path = typer.Argument(..., help='JSON list of {"namespace", "key", "value" | "delete": true, "scope"?}.'),
    topic: str = TopicOpt, author: Optional[str] = AuthorOpt, reason: str = ReasonOpt,
) -> None:
    """Publish several operations as one atomic change: all valid and applied, or none."""
    try:
        ops = [ConfigOp.model_validate(op) for op in json.loads(ops_file.read_text())]
    except (OSError, ValueError) as exc:
        raise ConfigCenterError(f"{ops_file}: {exc}") from None
    _print_applied(_center(topic).change(ops, author, reason))


@config_app.command("delete")
def delete(
    namespace: str = typer.Argument(...), key: str = typer.Argument(...),
    prefix: Optional[str] = PrefixOpt, share: Optional[float] = ShareOpt,
    topic: str = TopicOpt, author: Optional[str] = AuthorOpt, reason: str = ReasonOpt,
) -> None:
    """Delete a key (every value of it), or only its value for a scope."""
    _print_applied(_center(topic).delete(namespace, key, author, reason, _scope(prefix, share)))


@config_app.command("get")
def get(
    namespace: Optional[str] = typer.Argument(None), key: Optional[str] = typer.Argument(None),
    entity: Optional[str] = typer.Option(None, "--entity", help="Resolve scoped values for this entity key."),
    topic: str = TopicOpt,
) -> None:
    """Show values (all namespaces, one namespace, or one key) and the current version."""
    state = _center(topic).refresh()
    if namespace and key:
        value = state.get(namespace, key, entity)
        if value is None:
            raise ConfigCenterError(f"{namespace}/{key} has no value" + (f" for {entity}" if entity else ""))
        _console.print_json(json.dumps(value))
        return
    table = Table(title=f"config v{state.version} on {topic}" + (f" for {entity}" if entity else ""))
    for col in ("namespace", "key", "scope", "value"):
        table.add_column(col, overflow="fold")
    scopes = state.scopes()
    for (ns, k, label), value in sorted(state.cells().items()):
        if namespace and ns != namespace:
            continue
        scope = scopes[(ns, k, label)]
        if entity is not None and scope is not None and not scope.matches(entity):
            continue
        table.add_row(ns, k, label or "-", json.dumps(value))
    _console.print(table)


@config_app.command("history")
def history(
    namespace: Optional[str] = typer.Argument(None), key: Optional[str] = typer.Argument(None),
    topic: str = TopicOpt,
) -> None:
    """Every applied change (version, when, who, why, diff); refused ones are listed after."""
    state = _center(topic).refresh()
    table = Table(title=f"config history on {topic}")
    for col in ("version", "when (UTC)", "who", "why", "diff"):
        table.add_column(col, overflow="fold")
    for a in state.changes_of(namespace, key):
        table.add_row(f"v{a.version}", _when(a.change.at_ms), a.change.author, a.change.reason,
                      "\n".join(d.text() for d in a.diff))
    _console.print(table)
    for change, why in state.rejected:
        _console.print(f"not applied: change {change.id} by {change.author} at {_when(change.at_ms)}: {why}",
                       markup=False)


@config_app.command("diff")
def diff(
    a: str = typer.Argument(..., help="A version (12 or v12) or a snapshot name."),
    b: Optional[str] = typer.Argument(None, help="Another one; default: now."),
    topic: str = TopicOpt,
) -> None:
    """What differs between two versions or snapshots."""
    _print_diff(_center(topic).diff(a, b))


@config_app.command("snapshot")
def snapshot(
    name: str = typer.Argument(..., help="Name to save the current configuration under."),
    topic: str = TopicOpt, author: Optional[str] = AuthorOpt, reason: str = ReasonOpt,
) -> None:
    """Save the whole current configuration under a name."""
    snap = _center(topic).snapshot(name, author, reason)
    _console.print(f"snapshot [bold]{snap.name}[/] = config v{snap.version} ({len(snap.cells)} values)")


@config_app.command("restore")
def restore(
    target: str = typer.Argument(..., help="A snapshot name or a version (12 or v12)."),
    topic: str = TopicOpt, author: Optional[str] = AuthorOpt, reason: str = ReasonOpt,
) -> None:
    """Bring the values back to a snapshot or a version, as one new (audited) change."""
    _print_applied(_center(topic).restore(target, author, reason))
