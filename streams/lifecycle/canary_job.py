"""The canary job: a processor of the one delivery loop that runs a model's canary from live predictions.

It consumes the model's prediction topic(s) (``<app>.predictions.<model>``, and a shadow topic if
the worker writes one): every prediction names the ``model_version`` that made it and its
``confidence``. While the registry (``_tangram.models``, followed live by a
:class:`~streams.lifecycle.watcher.ModelRegistryWatcher`) shows a Challenger for the model, each
prediction feeds a :class:`~streams.lifecycle.canary.CanaryController`, and every ``tick_s``
(from ``process`` and, when no records arrive, from ``idle``) the controller decides and records
in the registry: start the canary, step its share, roll it back, or promote the challenger (see
:mod:`streams.lifecycle.canary` for what ends a canary). The inference workers follow the
registry, so each recorded decision reaches the traffic within their watcher's lag.

It writes nothing to Kafka but those registry events: no output topic. A prediction it cannot
decode goes to its ``dlq`` if the topology gives it one, and is counted either way (it stays on
its topic, where the rule processor and the drift job have their own say). While the model has no
Challenger it does not even decode: records are counted and committed, nothing else — the job
costs next to nothing until an operator promotes a challenger.

Run one replica per model: the decisions are the model's, not a partition's (``replicas > 1`` is
refused). State (the confidence windows) lives in memory; a restarted job judges on fresh
windows, and the schedule's intervals are read from the registry's own event times, so a restart
neither repeats nor skips a step.

Metrics (labels ``processor``, ``model``): ``tangram_models_canary_share``,
``tangram_models_canary_confidence_p50{arm}`` (``production``, ``canary``),
``tangram_models_canary_confidence_drop``, ``tangram_models_canary_predictions_total{arm}``,
``tangram_models_canary_verdicts_total{verdict}`` (``healthy``, ``unhealthy``, ``waiting``),
``tangram_models_canary_decisions_total{action}`` and ``tangram_models_canary_undecodable_total``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.context import BuildContext
from streams.delivery import Output, Processor, Record, dead_letter
from streams.errors import TopologyError
from streams.lifecycle.canary import CanaryController, Decision, Verdict
from streams.lifecycle.registry import MODELS_TOPIC, ModelRegistry
from streams.lifecycle.watcher import ModelRegistryWatcher
from streams.security.kafka import KafkaConnection
from streams.statelog import StateTopic

log = logging.getLogger("tangram.lifecycle.canary_job")

SHARE = Gauge("tangram_models_canary_share", "Share of entities the Challenger scores now (0: no canary).",
              ["processor", "model"])
P50 = Gauge("tangram_models_canary_confidence_p50", "Confidence p50 of each arm at the latest verdict.",
            ["processor", "model", "arm"])
DROP = Gauge("tangram_models_canary_confidence_drop", "Relative drop of the canary's confidence p50 below "
             "production's at the latest verdict (rollback above the schedule's bound).", ["processor", "model"])
SEEN = Counter("tangram_models_canary_predictions_total", "Predictions fed to the canary's health, by arm.",
               ["processor", "model", "arm"])
VERDICTS = Counter("tangram_models_canary_verdicts_total", "Health verdicts of the canary at each tick.",
                   ["processor", "model", "verdict"])
DECISIONS = Counter("tangram_models_canary_decisions_total", "Decisions applied: start, step, hold, rollback, promote.",
                    ["processor", "model", "action"])
UNDECODABLE = Counter("tangram_models_canary_undecodable_total", "Predictions the canary job could not decode.",
                      ["processor"])
TICK_SECONDS = Histogram("tangram_models_canary_tick_seconds", "One decision: registry catch-up, verdict, write.",
                         ["processor", "model"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

ARM_PRODUCTION, ARM_CANARY, ARM_OTHER = "production", "canary", "other"


class CanaryJobSettings(BaseModel):
    """The ``params`` of a canary processor in a topology."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="The registry model whose predictions the inputs carry.")
    registry_topic: str = Field(MODELS_TOPIC, description="The model registry's compacted topic.")
    tick_s: float = Field(5.0, gt=0, le=3600, description="How often a decision is taken; the model's canary "
                                                          "schedule (interval_s) paces the steps themselves.")
    window: int = Field(5000, ge=10, le=1_000_000, description="Confidences kept per version for the verdict.")
    actor: str | None = Field(None, description="Who the registry records as deciding; default `<app>.<processor>`.")


class CanaryJob(Processor):
    """Predictions → canary decisions recorded in the model registry (no output topic)."""

    name = "canary"
    singleton = True  # its decisions are the model's, not a partition's

    def __init__(self, *, codecs: dict[str, AvroCodec], kafka: KafkaConnection, settings: CanaryJobSettings,
                 actor: str, dlq_topic: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.codecs = codecs
        self.kafka = kafka
        self.settings = settings
        self.actor = actor
        self.dlq_topic = dlq_topic
        self.clock = clock
        self.registry: ModelRegistry | None = None
        self.watcher: ModelRegistryWatcher | None = None
        self.controller: CanaryController | None = None
        self._next_tick = 0.0
        self._last_action = ""

    @classmethod
    def build(cls, ctx: BuildContext) -> CanaryJob:
        settings = CanaryJobSettings.model_validate(ctx.spec.params)
        if ctx.spec.replicas != 1:  # singleton: decided per model, not per partition
            raise TopologyError(f"canary processor {ctx.name!r}: run exactly one replica (it decides for the whole "
                                f"model {settings.model!r}, not per partition), not {ctx.spec.replicas}")
        if ctx.spec.outputs:
            raise TopologyError(f"canary processor {ctx.name!r} writes only to the model registry; remove its "
                                f"outputs {ctx.spec.outputs}")
        for topic in ctx.spec.inputs:
            if topic.split(".")[1:2] != ["predictions"]:
                raise TopologyError(f"canary processor {ctx.name!r}: input {topic!r} is not a predictions topic "
                                    "(`<app>.predictions.*`)")
        return cls(codecs={t: ctx.codec(t) for t in ctx.spec.inputs}, kafka=ctx.stack.kafka,
                   settings=settings, actor=settings.actor or ctx.topology.group(ctx.name), dlq_topic=ctx.spec.dlq)

    # -- lifecycle -------------------------------------------------------------------
    def setup(self) -> None:
        s = self.settings
        StateTopic(self.kafka, s.registry_topic).ensure()
        self.registry = ModelRegistry(self.kafka, s.registry_topic)
        self.watcher = ModelRegistryWatcher(self.kafka, s.registry_topic, name=self.name).start()
        self.controller = CanaryController(self.registry, s.model, actor=self.actor, window=s.window)
        routing = self.watcher.current(s.model)
        SHARE.labels(self.name, s.model).set(routing.canary_share)
        log.info("%s: canary job of %s on %s as %s, deciding every %gs (now: production %s, challenger %s)",
                 self.name, s.model, ", ".join(self.codecs), self.actor, s.tick_s,
                 routing.production and routing.production.version, routing.challenger and routing.challenger.version)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.registry is not None:
            self.registry.close()

    # -- the loop's hooks ----------------------------------------------------------------
    def process(self, batch: list[Record]) -> list[Output]:
        assert self.watcher is not None and self.controller is not None, "setup() runs before the first batch"
        model = self.settings.model
        routing = self.watcher.current(model)
        outputs: list[Output] = []
        if routing.challenger is not None and routing.production is not None:
            arms = {routing.production.version: ARM_PRODUCTION, routing.challenger.version: ARM_CANARY}
            seen: Tally[str] = Tally()
            for record in batch:
                try:
                    value = self.codecs[record.topic].decode(record.value)
                    version, confidence = value["model_version"], float(value["confidence"])
                except (WireFormatError, KeyError, TypeError, ValueError) as exc:
                    UNDECODABLE.labels(self.name).inc()
                    log.warning("%s: %s undecodable prediction skipped: %s", self.name, record.where, exc)
                    if self.dlq_topic:
                        outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                    continue
                self.controller.observe(version, confidence)
                seen[arms.get(version, ARM_OTHER)] += 1
            for arm, n in seen.items():
                SEEN.labels(self.name, model, arm).inc(n)
        self._maybe_tick()
        return outputs

    def idle(self) -> list[Output]:
        self._maybe_tick()
        return []

    # -- decisions -------------------------------------------------------------------------
    def _maybe_tick(self) -> None:
        now = self.clock()
        if now < self._next_tick:
            return
        self._next_tick = now + self.settings.tick_s
        self.tick()

    def tick(self) -> Decision | None:
        """Decide now (if the model has a Challenger) and export what was decided; returns the decision."""
        assert self.watcher is not None and self.controller is not None and self.registry is not None
        model = self.settings.model
        routing = self.watcher.current(model)
        if routing.challenger is None or routing.production is None:
            SHARE.labels(self.name, model).set(0.0)
            return None
        started = time.perf_counter()
        action, verdict = self.controller.tick()
        TICK_SECONDS.labels(self.name, model).observe(time.perf_counter() - started)
        decision = self.controller.last
        assert decision is not None
        DECISIONS.labels(self.name, model, action).inc()
        self._export(verdict)
        SHARE.labels(self.name, model).set(self.registry.state.routing(model).canary_share)
        if action != "hold" or self._last_action != "hold":  # every change, and why it holds when it starts holding
            log.info("%s: %s %s: %s", self.name, model, action, decision.reason)
        self._last_action = action
        return decision

    def _export(self, verdict: Verdict | None) -> None:
        if verdict is None:
            return
        model = self.settings.model
        VERDICTS.labels(self.name, model, {True: "healthy", False: "unhealthy", None: "waiting"}[verdict.healthy]).inc()
        if verdict.baseline_p50 is not None and verdict.canary_p50 is not None and verdict.drop is not None:
            P50.labels(self.name, model, ARM_PRODUCTION).set(verdict.baseline_p50)
            P50.labels(self.name, model, ARM_CANARY).set(verdict.canary_p50)
            DROP.labels(self.name, model).set(verdict.drop)
