"""The demo's lifecycle drill: the model registry changes live while the app runs, and the traffic follows.

For an inference worker that follows the registry (``follow_registry``), ``tangram demo`` runs three
registry changes during its run and times each one from the registry event to the first prediction
by the version it names (the rollback RTO as a reader of the predictions sees it):

1. at a quarter of the run the drill version becomes **Challenger**: the canary job (when the app runs
   one) starts its canary at the model's schedule's first share — predictions by the drill version
   appear for that share of the entities;
2. at half the run it is promoted to **Production** (forced: the drill does not wait for the schedule);
3. at three quarters, **rollback**: the previous Production serves again, timed against the topology's
   declared ``rollback_rto_s``.

The drill version is the built version's artifact registered again under the next version number
(copied into the stack's model repository as Triton's next version folder): the same weights, so the
drill exercises the switch — registry, every worker's routing, Triton's explicit model control, the
canary job — not a new model. Before the run the built version is registered and made Production if
the registry has none (``tangram models build`` writes its model card).
"""

from __future__ import annotations

import shutil
import threading
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition
from rich.console import Console

from streams.avro import topic_codec
from streams.errors import ModelRegistryError
from streams.launcher import high_watermarks
from streams.lifecycle.artifacts import card_fields
from streams.lifecycle.registry import MODELS_TOPIC, ModelRegistry
from streams.lifecycle.repository import CARD_FILE
from streams.lifecycle.state import Stage
from streams.settings import StackSettings
from streams.topology import Kind, Topology

ACTOR = "tangram-demo"


@dataclass
class Step:
    at: float  # share of the run
    what: str
    target: str  # the version whose first prediction is timed
    event_ms: int = 0
    first_prediction_ms: int | None = None


class LifecycleDrill:
    """Registry changes during a demo run, each timed to the first prediction by its version (see the module)."""

    def __init__(self, topology: Topology, stack: StackSettings, console: Console):
        self.topology, self.stack, self.console = topology, stack, console
        self.worker = next(((n, s) for n, s in topology.processors_of(Kind.INFERENCE).items()
                            if s.params.get("follow_registry")), None)
        self.steps: list[Step] = []
        self.skipped = ""
        self._seen: dict[str, int] = {}  # version → first prediction time (ms) after the drill armed
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.worker is not None and not self.skipped

    def prepare(self) -> None:
        """Register the built version (Production when none is), and the drill version beside it."""
        if self.worker is None:
            self.skipped = "no inference worker follows the model registry"
            return
        name, spec = self.worker
        self.model = spec.params["model"]
        self.registry = ModelRegistry(self.stack.kafka, spec.params.get("registry_topic", MODELS_TOPIC))
        repository = self.stack.model_repository
        card = repository / self.model / CARD_FILE
        if not card.is_file():
            self.skipped = f"no model card {card} (run `tangram models build` and `tangram apply`)"
            return
        fields = {"owner": f"app {self.topology.app}", "license": "the app's own", **card_fields(card, repository)}
        built = str(fields["version"])
        model = self.registry.refresh().models.get(self.model)  # what the registry holds already
        if model is None or built not in model.versions:
            self.registry.register(fields, ACTOR, "built by `tangram models build`")
        model = self.registry.state.models[self.model]
        if model.production is None:
            self.registry.promote(self.model, built, Stage.PRODUCTION, ACTOR, "demo: the built model serves", force=True)
        model = self.registry.state.models[self.model]
        self.production = model.production
        folders = [int(p.name) for p in (repository / self.model).iterdir() if p.is_dir() and p.name.isdigit()]
        drill = str(max([*folders, *(int(v) for v in model.versions if v.isdigit())]) + 1)
        source = repository / self.model / self.production / "model.onnx"
        (repository / self.model / drill).mkdir(parents=True, exist_ok=True)
        shutil.copy(source, repository / self.model / drill / "model.onnx")
        artifact = f"{self.model}/{drill}/model.onnx"
        registered = self.registry.state.models[self.model].versions[self.production]
        self.registry.register({**registered.model_dump(mode="json"), "version": drill, "artifact": artifact},
                               ACTOR, f"drill: v{self.production}'s artifact again as v{drill} (same weights)")
        self.drill = drill
        self.steps = [Step(0.25, f"v{drill} → Challenger (the canary job starts its canary)", drill),
                      Step(0.5, f"v{drill} → Production", drill),
                      Step(0.75, f"rollback → v{self.production}", self.production)]
        self.console.print(f"lifecycle drill on {self.model}: Production v{self.production}; v{drill} (v{self.production}'s "
                           "artifact again) is promoted and rolled back while the demo runs")

    def start(self) -> None:
        """Follow the predictions from now on (the first prediction by each version after each step)."""
        if not self.active:
            return
        _, spec = self.worker
        topic = spec.outputs[0] if not spec.params.get("shadow_topic") else \
            next(t for t in spec.outputs if t != spec.params["shadow_topic"])
        decode = topic_codec(self.topology, self.stack.registry_url, topic).decode
        consumer = Consumer(self.stack.kafka.config({"group.id": f"drill-{uuid.uuid4().hex}",
                             "enable.auto.commit": False}))
        ends = high_watermarks(consumer, self.topology, [topic])
        consumer.assign([TopicPartition(tp.topic, tp.partition, end) for tp, end in ends.items()])

        def follow() -> None:
            try:
                while not self._halt.is_set():
                    for m in consumer.consume(500, 0.2):
                        if m.error() is None:
                            self._observe(decode(m.value())["model_version"], m.timestamp()[1])
            finally:
                consumer.close()

        self._thread = threading.Thread(target=follow, daemon=True, name="drill-predictions")
        self._thread.start()

    def _observe(self, version: str, ts_ms: int) -> None:
        for step in self.steps:
            if step.event_ms and step.first_prediction_ms is None and version == step.target and ts_ms >= step.event_ms:
                step.first_prediction_ms = ts_ms
                self.console.print(f"  [bold cyan]drill[/] {step.what}: first prediction by v{version} "
                                   f"{ts_ms - step.event_ms} ms after the registry event")

    def tick(self, progress: float) -> None:
        """Run the steps due at ``progress`` (the share of the run done)."""
        for step in self.steps:
            if step.event_ms or progress < step.at:
                continue
            try:
                if step.at == 0.25:
                    event = self.registry.promote(self.model, self.drill, Stage.CHALLENGER, ACTOR, "demo drill")
                elif step.at == 0.5:
                    event = self.registry.promote(self.model, self.drill, Stage.PRODUCTION, ACTOR, "demo drill",
                                                  force=True)
                else:
                    event = self.registry.rollback(self.model, ACTOR, "demo drill: back to the previous version")
            except ModelRegistryError as exc:
                self.console.print(f"  [yellow]drill[/] {step.what} refused: {exc}")
                step.event_ms = -1
                continue
            step.event_ms = event.at_ms
            self.console.print(f"  [bold cyan]drill[/] {step.what}: {event.summary()} recorded")

    def stop(self) -> list[Step]:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.worker is not None and hasattr(self, "registry"):
            self.registry.close()
        return self.steps

    def summary(self) -> list[str]:
        if self.skipped:
            return [f"lifecycle drill skipped: {self.skipped}"]
        rto = self.worker[1].evolution.rollback_rto_s if self.worker else None
        lines = []
        for step in self.steps:
            if step.event_ms <= 0:
                lines.append(f"drill {step.what}: not done")
            elif step.first_prediction_ms is None:
                lines.append(f"drill {step.what}: no prediction by v{step.target} seen after it")
            else:
                took = (step.first_prediction_ms - step.event_ms) / 1000
                declared = f" (declared rollback_rto_s {rto:g} s)" if rto and step.at == 0.75 else ""
                lines.append(f"drill {step.what}: first prediction by v{step.target} {took:.2f} s after the registry "
                             f"event{declared}")
        return lines
