"""CLI of the data contracts and the ingest gateway: ``tangram schemas | gateway | dlq``.

Registered on the main CLI (``streams/cli.py``) as sub-apps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from streams.settings import StackSettings

schemas_app = typer.Typer(help="Data contracts: an app's Avro schemas and their compatibility.", no_args_is_help=True)
gateway_app = typer.Typer(help="Ingest gateways: HTTP and MQTT producers reach the ingest contracts; HTTP uploads of files.",
                          no_args_is_help=True)
dlq_app = typer.Typer(help="Dead-letter topics: inspect refused records, replay them after a fix.", no_args_is_help=True)


@schemas_app.command("check")
def schemas_check(
    app: Path = typer.Argument(..., help="The app (its folder or topology file): its `schemas:` folder is checked."),
    registry: Optional[str] = typer.Option(None, help="Compare with this schema registry (URL) instead of git."),
    stack_registry: bool = typer.Option(False, "--stack-registry", help="Compare with the local stack's registry."),
    git_ref: str = typer.Option("HEAD", "--git-ref", help="Compare with the versions in git up to this ref."),
    subject: Optional[list[str]] = typer.Option(None, "--subject", help="Only these subjects (repeatable)."),
) -> None:
    """Fail if a schema changed incompatibly under its subject's level (compatibility.yaml beside the schemas)."""
    from rich.console import Console
    from rich.table import Table

    from streams.schemas_check import GitHistory, RegistryHistory, check_schemas
    from streams.topology import load_topology

    schema_dir = load_topology(app).schema_dir
    url = registry or (StackSettings().registry_url if stack_registry else None)
    history = RegistryHistory(url) if url else GitHistory.around(schema_dir, git_ref)
    reports = check_schemas(history, schema_dir, subjects=subject)
    console = Console()
    table = Table(title=f"schemas check against {url or f'git {git_ref}'}")
    for col in ("subject", "level", "compared with", "result"):
        table.add_column(col)
    for r in reports:
        table.add_row(r.subject, r.level, r.compared_with, "[green]ok[/]" if r.ok else f"[red]{len(r.problems)} problem(s)[/]")
    console.print(table)
    problems = [p for r in reports for p in r.problems]
    for p in problems:
        console.print(f"[red]incompatible:[/] {p}", soft_wrap=True)
    if problems:
        console.print("fix the schema (add a default, keep the field, widen the type) or change the subject's level in "
                      f"{schema_dir / 'compatibility.yaml'} on purpose")
        raise typer.Exit(1)


@gateway_app.command("http")
def gateway_http(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    stream: Optional[list[str]] = typer.Option(None, "--stream", help="Serve only these gateway streams (default: all)."),
    port: Optional[int] = typer.Option(None, help="Listen port (default 8088, or TANGRAM_HTTP_GATEWAY_PORT)."),
    host: Optional[str] = typer.Option(None, help="Listen address (default 127.0.0.1)."),
    metrics_port: Optional[int] = typer.Option(None, help="Serve Prometheus metrics on this port."),
) -> None:
    """Serve POST /v1/streams/{stream}/events until SIGTERM."""
    from streams.gateway.http import HttpGatewaySettings, serve

    overrides = {k: v for k, v in {"port": port, "host": host}.items() if v is not None}
    stack = _gateway_stack(topology)
    _metrics(metrics_port, stack)
    serve(topology, stream, stack, HttpGatewaySettings(**overrides))


@gateway_app.command("upload")
def gateway_upload(
    topology: Path = typer.Argument(..., help="The app (its folder or topology file): its `uploads:` are served."),
    port: Optional[int] = typer.Option(None, help="Listen port (default 8089, or TANGRAM_UPLOAD_GATEWAY_PORT)."),
    host: Optional[str] = typer.Option(None, help="Listen address (default 127.0.0.1)."),
    metrics_port: Optional[int] = typer.Option(None, help="Serve Prometheus metrics on this port."),
) -> None:
    """Serve POST /v1/uploads/{name} (multipart/form-data files) until SIGTERM."""
    from streams.gateway.upload import UploadGatewaySettings, serve

    overrides = {k: v for k, v in {"port": port, "host": host}.items() if v is not None}
    stack = _gateway_stack(topology)
    _metrics(metrics_port, stack)
    serve(topology, stack, UploadGatewaySettings(**overrides))


@gateway_app.command("mqtt")
def gateway_mqtt(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    stream: Optional[list[str]] = typer.Option(None, "--stream", help="Only these gateway streams (default: all with mqtt_topics)."),
    broker_host: Optional[str] = typer.Option(None, "--broker-host", help="MQTT broker address (default 127.0.0.1)."),
    broker_port: Optional[int] = typer.Option(None, "--broker-port", help="MQTT broker port (default 1883)."),
    metrics_port: Optional[int] = typer.Option(None, help="Serve Prometheus metrics on this port."),
) -> None:
    """Subscribe to the streams' MQTT topics and forward validated readings until SIGTERM."""
    from streams.gateway.mqtt import MqttGatewaySettings, serve

    overrides = {k: v for k, v in {"host": broker_host, "port": broker_port}.items() if v is not None}
    stack = _gateway_stack(topology)
    settings = MqttGatewaySettings(**overrides)
    operator = StackSettings()
    if operator.secure and settings.username is None:  # its broker user, as `tangram gateway mqtt-auth` wrote it
        from streams.security.acls import gateway_principal
        from streams.topology import load_topology

        user = gateway_principal(load_topology(topology))
        settings = MqttGatewaySettings(**overrides, username=user, password=operator.secrets.get("mqtt", user))
    _metrics(metrics_port, stack)
    serve(topology, stream, stack, settings)


def _gateway_stack(topology: Path) -> StackSettings:
    """The gateway's settings: on a secured local stack, the app's gateway principal, never the operator."""
    stack = StackSettings()
    if not stack.secure:
        return stack
    from streams.security.acls import gateway_principal
    from streams.security.local import settings_as
    from streams.topology import load_topology

    return settings_as(stack, gateway_principal(load_topology(topology)))


def _metrics(port: int | None, stack: StackSettings) -> None:
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=stack.host)


@dlq_app.command("inspect")
def dlq_inspect(
    topic: str = typer.Argument(..., help="DLQ topic, e.g. pm.dlq.ingest."),
    reason: Optional[str] = typer.Option(None, help="Only records refused for this reason."),
    from_offset: int = typer.Option(0, help="Start at this offset in every partition."),
    limit: int = typer.Option(50, help="Most records to show."),
) -> None:
    """List dead letters: where they came from, why they were refused, their key and value."""
    from collections import Counter

    from rich.console import Console
    from rich.table import Table

    from streams.dlq import read

    letters = list(read(StackSettings().kafka, topic, from_offset=from_offset, reason=reason, limit=limit))
    table = Table(title=f"{topic}: {len(letters)} record(s)" + (f" with reason {reason}" if reason else ""))
    for col in ("partition@offset", "key", "reason", "stage", "message", "source", "value"):
        table.add_column(col, overflow="fold")
    for d in letters:
        key = d.key.decode("utf-8", "backslashreplace") if d.key is not None else ""
        value = (d.value or b"")[:80].decode("utf-8", "backslashreplace")
        table.add_row(f"{d.partition}@{d.offset}", key, d.reason, d.header("dlq.stage"),
                      d.header("dlq.error_message")[:160], d.source, value)
    console = Console()
    console.print(table)
    for r, n in Counter(d.reason for d in letters).most_common():
        console.print(f"  {r}: {n}")


@dlq_app.command("replay")
def dlq_replay(
    topic: str = typer.Argument(..., help="DLQ topic to read, e.g. pm.dlq.ingest."),
    to: str = typer.Option(..., "--to", help="Topic to send the records to (normally the stage's input)."),
    reason: Optional[str] = typer.Option(None, help="Only records refused for this reason."),
    from_offset: int = typer.Option(0, help="Start at this offset in every partition."),
    limit: Optional[int] = typer.Option(None, help="Most records to replay."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be replayed; send nothing."),
) -> None:
    """Send dead letters back (original key, value and headers), after the fix that makes them pass."""
    from rich.console import Console

    from streams.dlq import replay

    n = replay(StackSettings().kafka, topic, to, reason=reason, from_offset=from_offset, limit=limit,
               dry_run=dry_run)
    Console().print(f"{'would replay' if dry_run else 'replayed'} {n} record(s) from {topic} to {to}"
                    + (f" (reason {reason})" if reason else ""))
