"""The one CLI: `tangram up | down | status | plan | apply | run | demo | model | models | config | stack`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from streams.config_center.cli import config_app
from streams.lifecycle.cli import models_app
from streams.settings import StackSettings

app = typer.Typer(help="Tangram: Kafka-native streaming dataflow for production AI.", no_args_is_help=True)
stack_app = typer.Typer(help="Local stack chores.", no_args_is_help=True)
model_app = typer.Typer(help="The reference model.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(model_app, name="model")
app.add_typer(models_app, name="models")
app.add_typer(config_app, name="config")
from streams.gateway.cli import dlq_app, gateway_app, schemas_app  # noqa: E402  (data contracts, gateways, DLQ)
app.add_typer(schemas_app, name="schemas")
app.add_typer(gateway_app, name="gateway")
app.add_typer(dlq_app, name="dlq")


def _settings() -> StackSettings:
    return StackSettings()


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def up() -> None:
    """Start Kafka (KRaft), the schema registry, Redis and Triton on 127.0.0.1."""
    from streams.stack import up as stack_up

    stack_up(_settings())


@app.command()
def down() -> None:
    """Stop every component of the local stack (its data stays under TANGRAM_HOME)."""
    from streams.stack import down as stack_down

    stack_down(_settings())


@app.command()
def status() -> None:
    """Show each component: pid, address, ready or not."""
    from streams.stack import status as stack_status

    raise typer.Exit(0 if stack_status(_settings()) else 1)


@stack_app.command("jars")
def stack_jars() -> None:
    """Resolve the Kafka jars with Maven (cached in ~/.m2) into TANGRAM_HOME."""
    from streams.stack import fetch_jars

    fetch_jars(_settings())


@model_app.command("train")
def model_train(
    seed: int = typer.Option(42, help="Random seed of the simulated training fleet."),
    force: bool = typer.Option(False, help="Retrain even if the model exists."),
) -> None:
    """Train the reference anomaly model on simulated data and export it to ONNX for Triton."""
    from rich.console import Console

    from inference_workers.train import MODEL_NAME, train

    repo = _settings().model_repository
    if (repo / MODEL_NAME / "1" / "model.onnx").exists() and (repo / MODEL_NAME / "model_card.json").exists() and not force:
        Console().print(f"model {MODEL_NAME} v1 already trained in {repo} (use --force to retrain)")
        return
    card = train(repo, seed=seed)
    m = card["metrics"]
    Console().print(
        f"[bold]{MODEL_NAME}[/] v{card['version']} dataset {card['dataset_version']}: "
        f"held-out accuracy {m['accuracy']:.4f}; "
        + ", ".join(f"{k} P={v['precision']:.3f} R={v['recall']:.3f}" for k, v in m["per_class"].items())
    )


def _show_changes(changes, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not changes:
        console.print(f"{title}: nothing to change")
        return
    table = Table(title=title)
    for col in ("change", "target", "detail"):
        table.add_column(col)
    for c in changes:
        table.add_row(c.kind, c.target, c.detail)
    console.print(table)


@app.command()
def plan(topology: Path = typer.Argument(..., help="Topology YAML file.")) -> None:
    """Show what `apply` would change on the broker and the schema registry."""
    from streams.plan import plan as make_plan
    from streams.topology import load_topology

    _show_changes(make_plan(load_topology(topology), _settings()), f"plan for {topology}")


@app.command()
def apply(topology: Path = typer.Argument(..., help="Topology YAML file.")) -> None:
    """Create topics and register schemas so the stack matches the topology (idempotent)."""
    from streams.plan import apply as do_apply
    from streams.topology import load_topology

    _show_changes(do_apply(load_topology(topology), _settings()), f"applied {topology}")


@app.command()
def run(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    processor: str = typer.Argument(..., help="Processor name in the topology."),
    metrics_port: Optional[int] = typer.Option(None, help="Serve Prometheus metrics on this port."),
) -> None:
    """Run one processor of a topology until SIGTERM (at-least-once unless the topology asks exactly-once)."""
    from streams.run import run as run_processor

    run_processor(topology, processor, _settings(), metrics_port)


@app.command()
def demo(
    duration: float = typer.Option(60.0, help="Seconds of simulated telemetry."),
    devices: int = typer.Option(20, help="Fleet size (the first eight carry faults)."),
    seed: int = typer.Option(7, help="Simulator seed."),
) -> None:
    """Run the predictive-maintenance application on the local stack and score it against the ground truth."""
    from streams.demo import run_demo

    run_demo(_settings(), duration, devices, seed)


def entry() -> None:
    """Console entry point: operator errors print as one clear line, not a traceback."""
    from rich.console import Console

    from streams.errors import TangramError

    try:
        app()
    except TangramError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise SystemExit(2) from None


@app.command()
def diagram(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    out: Optional[Path] = typer.Option(None, help="Output path without suffix; default docs/images/<file stem>."),
    formats: str = typer.Option("svg,png,mmd", help="Comma-separated: svg, png, mmd (Mermaid), dot."),
) -> None:
    """Draw the topology with its constraints (SVG/PNG via Graphviz, Mermaid text)."""
    from rich.console import Console

    from streams import PROJECT_ROOT
    from streams.diagram import render
    from streams.topology import load_topology

    base = out or PROJECT_ROOT / "docs" / "images" / topology.stem
    for path in render(load_topology(topology), base, tuple(f.strip() for f in formats.split(",") if f.strip())):
        Console().print(f"wrote {path}")


@app.command()
def verify(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    load_seconds: float = typer.Option(20.0, help="Duration of step 4's load at the declared baseline rate."),
    kill: str = typer.Option("inference", help="The processor step 4 kills with SIGKILL and restarts."),
) -> None:
    """Run the four-step verification (protocol, connectivity, chain, load+chaos); non-zero exit on a violation."""
    from streams.verify import verify as run_verify

    checks = run_verify(topology, _settings(), load_seconds, kill)
    raise typer.Exit(0 if all(c.ok for c in checks) else 1)
