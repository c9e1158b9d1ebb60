"""CLI of the security chores: ``tangram keys | erase | erasures`` and ``tangram gateway mqtt-auth``.

Registered on the main CLI (``streams/cli.py``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from streams.config_center import CONFIG_TOPIC
from streams.settings import StackSettings

keys_app = typer.Typer(help="The gateways' API keys: hashed, scoped to streams, audited in the config center.",
                       no_args_is_help=True)
_console = Console()

TopicOpt = typer.Option(CONFIG_TOPIC, "--topic", help="The config center topic holding the keys.")
ActorOpt = typer.Option(None, "--actor", help="Who makes the change (default: the OS user).")
ReasonOpt = typer.Option("", "--reason", "-m", help="Why: recorded with the change.")


def _center(topic: str):
    from streams.config_center import ConfigCenter

    return ConfigCenter(StackSettings().kafka, topic)


def _when(ms: int | None) -> str:
    return "never" if ms is None else datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


@keys_app.command("create")
def keys_create(
    app: Path = typer.Argument(..., help="The app (its folder or topology file) whose gateways accept the key."),
    identity: str = typer.Option(..., "--identity", help="Who the key proves: a client, a site, a tenant."),
    stream: list[str] = typer.Option(..., "--stream", help="A gateway stream or an upload it may write (repeatable)."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Readings per second, sustained (default 100)."),
    burst: Optional[int] = typer.Option(None, "--burst", help="Readings at once after a quiet period (default 1000)."),
    dlq_per_hour: Optional[int] = typer.Option(None, "--dlq-per-hour", help="Dead letters per hour (default 1000)."),
    expires_days: Optional[float] = typer.Option(None, "--expires-days", help="Refused after this many days."),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Make a key; it is printed once, only its hash is kept."""
    from streams.security.keys import create
    from streams.topology import load_topology

    topology = load_topology(app)
    writable = [*topology.gateways, *topology.uploads]
    unknown = sorted(set(stream) - set(writable))
    if unknown:
        raise typer.BadParameter(f"app {topology.app!r} has no gateway stream or upload {', '.join(unknown)} "
                                 f"(it has: {', '.join(writable) or 'none'})", param_hint="--stream")
    import time

    expires = int((time.time() + expires_days * 86400) * 1000) if expires_days else None
    made = create(_center(topic), identity, topology.app, list(dict.fromkeys(stream)), author=actor, reason=reason,
                  rate_per_s=rate, burst=burst, dlq_per_hour=dlq_per_hour, expires_ms=expires)
    _console.print(f"key [bold]{made.key_id}[/] for {identity} on {topology.app} ({', '.join(made.record.streams)}); "
                   "hand it over now, it is not shown again:")
    print(made.token)


@keys_app.command("list")
def keys_list(topic: str = TopicOpt) -> None:
    """The keys the gateways accept (never their secrets)."""
    from streams.security.keys import NAMESPACE, ApiKey

    state = _center(topic).refresh()
    table = Table(title="gateway API keys")
    for col in ("id", "identity", "app", "streams", "rate/s", "burst", "dlq/h", "expires"):
        table.add_column(col)
    for key_id, raw in sorted(state.namespace(NAMESPACE).items()):
        k = ApiKey.model_validate(raw)
        table.add_row(key_id, k.identity, k.app, ", ".join(k.streams), f"{k.rate_per_s:g}", str(k.burst),
                      str(k.dlq_per_hour), _when(k.expires_ms))
    _console.print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., help="The key's id (`tangram keys list`)."),
                topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt) -> None:
    """Revoke a key: the gateways refuse it within about a second."""
    from streams.security.keys import revoke

    revoke(_center(topic), key_id, author=actor, reason=reason)
    _console.print(f"revoked key {key_id}; `tangram config history` shows who and why")


def erase(
    app: Path = typer.Argument(..., help="The app (its folder or topology file)."),
    entity: str = typer.Argument(..., help="The entity key (a device id, a card id, ...) as the app writes it."),
    actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Erase an entity: its online features, tombstones on the app's compacted topics; the erasure is recorded."""
    from streams.security.erase import erase as run_erase
    from streams.topology import load_topology

    done = run_erase(load_topology(app), entity, StackSettings(), actor=actor, reason=reason)
    topics = ", ".join(f"{t} ({n})" for t, n in done.tombstones.items()) or "none"
    _console.print(f"erasure {done.id}: {done.redis_keys} online-store key(s) deleted; tombstones on {topics}; "
                   f"recorded by {done.actor} at {_when(done.at_ms)} (entity kept as sha256 {done.entity_sha256[:16]}...)")


def erasures(app: Optional[str] = typer.Option(None, "--app", help="Only this app's erasures.")) -> None:
    """The recorded erasures: who erased what and when (the entity only as a digest)."""
    from streams.security.erase import erasures as recorded

    table = Table(title="erasures")
    for col in ("when", "app", "entity sha256", "by", "reason", "redis keys", "tombstones"):
        table.add_column(col, overflow="fold")
    for e in recorded(StackSettings(), app):
        table.add_row(_when(e["at_ms"]), e["app"], e["entity_sha256"][:16], e["actor"], e["reason"],
                      str(e["redis_keys"]), ", ".join(f"{t} ({n})" for t, n in e["tombstones"].items()))
    _console.print(table)


def mqtt_auth(
    app: Path = typer.Argument(..., help="The app whose gateway streams declare `mqtt_topics`."),
    out: Path = typer.Option(..., "--out", help="Folder for mosquitto.conf, passwords and acl."),
    device: list[str] = typer.Option([], "--device", help="A device user (repeatable); its password is made in "
                                                          "the secret store on first use."),
    run_as: Optional[str] = typer.Option(None, "--run-as", help="The user Mosquitto keeps when started as root."),
) -> None:
    """Write Mosquitto's password and ACL files: no anonymous access, each device writes its own topic only."""
    from streams.gateway.mqtt_auth import write_broker_files
    from streams.security.acls import gateway_principal
    from streams.topology import load_topology

    topology = load_topology(app)
    stack = StackSettings()
    gateway = gateway_principal(topology)
    passwords = {d: stack.secrets.get("mqtt", d).get_secret_value() for d in device}
    files = write_broker_files(topology, out, gateway, stack.secrets.get("mqtt", gateway).get_secret_value(), passwords,
                               run_as=run_as)
    _console.print(f"wrote {files.conf}, {files.passwords}, {files.acl}; passwords are in "
                   f"{stack.secrets.root / 'mqtt'} (the adapter's: {gateway})")


def registry_user(
    users_file: Path = typer.Argument(..., help="The registry's users file (made if missing)."),
    name: str = typer.Argument(..., help="The user (basic auth's user name)."),
    role: str = typer.Option(..., "--role", help="admin (everything) or read-only (reads, lookups, compatibility tests)."),
    password: str = typer.Option(..., envvar="TANGRAM_REGISTRY_USER_PASSWORD", prompt=True, hide_input=True,
                                 help="Its password (prompted, or TANGRAM_REGISTRY_USER_PASSWORD)."),
) -> None:
    """Add or replace a user of the schema registry's users file (scrypt hash, never the password)."""
    from streams.registry.auth import RegistryUsers

    if role not in ("admin", "read-only"):
        raise typer.BadParameter("admin or read-only", param_hint="--role")
    users = RegistryUsers.load(users_file) if users_file.exists() else RegistryUsers()
    users.with_user(name, role, password).save(users_file)  # type: ignore[arg-type]
    _console.print(f"{name} ({role}) in {users_file}")
