"""``tangram models …``: build an app's models; register, list, show, promote, canary, rollback, archive, history."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from streams.errors import ModelRegistryError
from streams.lifecycle.registry import MODELS_TOPIC, ModelRegistry
from streams.lifecycle.state import ModelEvent, Stage
from streams.settings import StackSettings

models_app = typer.Typer(help="Model lifecycle: the registry on the compacted topic _tangram.models.",
                         no_args_is_help=True)
_console = Console()

TopicOpt = typer.Option(MODELS_TOPIC, "--topic", help="The registry topic.")
ActorOpt = typer.Option(None, "--actor", help="Who makes the change (default: the OS user).")
ReasonOpt = typer.Option("", "--reason", "-m", help="Why: recorded with the change.")


def _registry(topic: str) -> ModelRegistry:
    return ModelRegistry(StackSettings().kafka, topic)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _json_option(text: Optional[str], what: str) -> Any:
    if text is None:
        return None
    source = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        return json.loads(source)
    except ValueError as exc:
        raise ModelRegistryError(f"{what} is not valid JSON ({exc}); pass JSON text or @file.json") from exc


@models_app.command("build")
def build(
    app: Path = typer.Argument(..., help="The app (its folder or topology file)."),
    repository: Optional[Path] = typer.Option(None, "--repository", help="Write into this model repository "
                                              "(a model server's volume) instead of the app's own."),
    force: bool = typer.Option(False, "--force", help="Rebuild artifacts that exist already."),
) -> None:
    """Build the app's model artifacts with its `models.build` hook (its training or export script)."""
    from streams.lifecycle.repository import build_models
    from streams.topology import load_topology

    _console.print(build_models(load_topology(app), repository, force))


@models_app.command("register")
def register(
    card: Optional[Path] = typer.Option(None, "--card", help="model_card.json written by `tangram models build`."),
    name: Optional[str] = typer.Option(None, "--name"),
    version: Optional[str] = typer.Option(None, "--version"),
    artifact: Optional[Path] = typer.Option(None, "--artifact", help="The model file (its sha256 is computed)."),
    framework: Optional[str] = typer.Option(None, "--framework"),
    dataset_version: Optional[str] = typer.Option(None, "--dataset-version", help="Mandatory: the training data's version."),
    owner: str = typer.Option(..., "--owner", help="Who answers for the model."),
    license_: str = typer.Option(..., "--license", help="The model's license."),
    inputs: Optional[str] = typer.Option(None, "--inputs", help="Input tensors, JSON or @file."),
    outputs: Optional[str] = typer.Option(None, "--outputs", help="Output tensors, JSON or @file."),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="Training metrics {name: number}, JSON or @file."),
    evaluation: Optional[str] = typer.Option(None, "--evaluation", help="Evaluation report, JSON or @file."),
    description: str = typer.Option("", "--description"),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Register a model version in Staging (refused without a dataset version)."""
    from streams.lifecycle.artifacts import card_fields, sha256_file

    repository = StackSettings().model_repository
    fields: dict[str, Any] = card_fields(card, repository) if card else {}
    if artifact is not None:
        fields["sha256"] = sha256_file(artifact)
        try:
            fields["artifact"] = str(artifact.resolve().relative_to(repository.resolve()))
        except ValueError:
            fields["artifact"] = str(artifact.resolve())
    given = {"name": name, "version": version, "framework": framework, "dataset_version": dataset_version,
             "owner": owner, "license": license_, "description": description or None,
             "inputs": _json_option(inputs, "--inputs"), "outputs": _json_option(outputs, "--outputs"),
             "training_metrics": _json_option(metrics, "--metrics"),
             "evaluation": _json_option(evaluation, "--evaluation")}
    fields.update({k: v for k, v in given.items() if v is not None})
    registry = _registry(topic)
    try:
        mv = registry.register(fields, actor, reason)
    finally:
        registry.close()
    _console.print(f"registered [bold]{mv.name}[/] {mv.version} in Staging: sha256 {mv.sha256[:16]}…, "
                   f"dataset {mv.dataset_version}")


@models_app.command("list")
def list_(topic: str = TopicOpt) -> None:
    """Every model: its Production, Challenger (with canary share) and versions by stage."""
    state = _registry(topic).refresh()
    table = Table(title=f"models on {topic}")
    for col in ("model", "production", "challenger", "canary", "staging", "archived", "events"):
        table.add_column(col)
    for name, m in sorted(state.models.items()):
        by = {s: [v for v, st in m.stages.items() if st is s] for s in Stage}
        table.add_row(name, m.production or "-", m.challenger or "-",
                      f"{m.canary_share:.0%}" if m.challenger else "-", ", ".join(by[Stage.STAGING]) or "-",
                      ", ".join(by[Stage.ARCHIVED]) or "-", str(len(m.events)))
    _console.print(table)


@models_app.command("show")
def show(name: str = typer.Argument(...), version: Optional[str] = typer.Argument(None), topic: str = TopicOpt) -> None:
    """A model's routing and policy, or one version's full record (JSON)."""
    state = _registry(topic).refresh()
    m = state.model(name)
    if version is not None:
        record = state.version(name, version).model_dump(mode="json")
        record["stage"] = m.stages[version].value
        _console.print_json(json.dumps(record))
        return
    _console.print_json(json.dumps({"routing": m.routing().model_dump(mode="json"),
                                    "stages": {v: s.value for v, s in m.stages.items()},
                                    "production_history": m.production_history,
                                    "policy": m.policy.model_dump(mode="json")}))


@models_app.command("promote")
def promote(
    name: str = typer.Argument(...), version: str = typer.Argument(...),
    to: str = typer.Option(..., "--to", help="Challenger, Production (or Staging)."),
    force: bool = typer.Option(False, "--force", help="Skip the admission rule (recorded)."),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Move a version to a stage; Challenger → Production passes the model's admission rule."""
    event = _registry(topic).promote(name, version, to, actor, reason, force=force)
    _print_event(event)


@models_app.command("canary")
def canary(
    name: str = typer.Argument(...), share: float = typer.Argument(..., help="0..1; 0 = shadow only."),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Give the Challenger a share of the entities (by stable hash of the key)."""
    _print_event(_registry(topic).set_canary(name, share, actor, reason))


@models_app.command("evidence")
def evidence(
    name: str = typer.Argument(...), version: str = typer.Argument(...),
    events: int = typer.Option(..., help="Shadow-scored events this report covers."),
    metric: str = typer.Option(..., help="Metric name, e.g. accuracy."),
    challenger: float = typer.Option(..., help="The metric for the challenger."),
    production: Optional[float] = typer.Option(None, help="The metric for production over the same events."),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Record shadow-scoring evidence for the Challenger (what the admission rule reads)."""
    _print_event(_registry(topic).record_shadow(name, version, events, metric, challenger, production, actor, reason))


@models_app.command("policy")
def policy(
    name: str = typer.Argument(...), spec: str = typer.Argument(..., help="ModelPolicy JSON or @file.json."),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Declare a model's admission rule and canary schedule."""
    _print_event(_registry(topic).set_policy(name, _json_option(spec, "policy"), actor, reason))


@models_app.command("rollback")
def rollback(name: str = typer.Argument(...), topic: str = TopicOpt, actor: Optional[str] = ActorOpt,
             reason: str = ReasonOpt) -> None:
    """Make the previous Production version current again (the current one is archived)."""
    started = time.perf_counter()
    event = _registry(topic).rollback(name, actor, reason)
    _print_event(event)
    _console.print(f"recorded in {(time.perf_counter() - started) * 1000:.0f} ms; watchers apply it as they read it")


@models_app.command("archive")
def archive(
    name: str = typer.Argument(...), version: str = typer.Argument(...),
    force: bool = typer.Option(False, "--force", help="Allow archiving the Production version."),
    topic: str = TopicOpt, actor: Optional[str] = ActorOpt, reason: str = ReasonOpt,
) -> None:
    """Archive a version (metadata kept for audit)."""
    _print_event(_registry(topic).archive(name, version, actor, reason, force=force))


@models_app.command("history")
def history(name: str = typer.Argument(...), topic: str = TopicOpt) -> None:
    """Every recorded change of a model: when, who, what, why."""
    m = _registry(topic).refresh().model(name)
    table = Table(title=f"history of {name}")
    for col in ("#", "when (UTC)", "who", "what", "why"):
        table.add_column(col)
    for i, e in enumerate(m.events, 1):
        table.add_row(str(i), _when(e.at_ms), e.actor, e.summary(), e.reason)
    _console.print(table)


def _print_event(event: ModelEvent) -> None:
    _console.print(f"{event.model}: {event.summary()} — by {event.actor} at {_when(event.at_ms)}"
                   + (f" ({event.reason})" if event.reason else ""))
    verdict = event.data.get("admission")
    if verdict:
        _console.print(f"admission: {'passed' if verdict['passed'] else 'FORCED past'}: {verdict['detail']}")
