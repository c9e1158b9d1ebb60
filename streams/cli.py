"""The one CLI: `tangram up | down | status | plan | apply | run | demo | model | stack`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from streams.settings import StackSettings

app = typer.Typer(help="Tangram: Kafka-native streaming dataflow for production AI.", no_args_is_help=True)
stack_app = typer.Typer(help="Local stack chores.", no_args_is_help=True)
model_app = typer.Typer(help="The reference model.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(model_app, name="model")


def _settings() -> StackSettings:
    return StackSettings()


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


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
