"""The model registry on the compacted topic ``_tangram.models``: the writer side.

:class:`ModelRegistry` catches up with the topic before every change, validates the change
against that state (``streams.lifecycle.state``), appends the resulting events (idempotent
producer, ``acks=all``, deadline) and applies them only once the broker acknowledged them.
Readers — ``tangram models list|show|history`` and the :class:`~streams.lifecycle.watcher.ModelRegistryWatcher`
that inference workers embed — fold the same events.

Writers are expected to be operators and controllers, a few changes a minute; two writers
racing on the same model are ordered by the topic (the later event wins in every reader).
"""

from __future__ import annotations

import logging
from typing import Any

from streams.errors import ModelRegistryError
from streams.security.kafka import KafkaConnection
from streams.lifecycle.state import ModelEvent, ModelPolicy, ModelVersion, ModelRegistryState, Stage, version_from_fields
from streams.statelog import Replica, StateTopic, default_actor

log = logging.getLogger("tangram.lifecycle")

MODELS_TOPIC = "_tangram.models"


class ModelRegistry(Replica):
    """Register versions and move them through their stages, on ``_tangram.models``."""

    def __init__(self, kafka: KafkaConnection, topic: str = MODELS_TOPIC, timeout_s: float = 10.0) -> None:
        super().__init__(StateTopic(kafka, topic, timeout_s), ModelRegistryState())

    def _commit(self, events: list[ModelEvent]) -> list[ModelEvent]:
        if events:
            self.topic.append([e.record() for e in events])
            for event in events:
                self.state.apply(event)
                log.info("%s: %s by %s (%s)", event.model, event.summary(), event.actor, event.reason or "no reason")
        return events

    # ---- changes ------------------------------------------------------------------------

    def register(self, fields: dict[str, Any] | ModelVersion, actor: str | None = None, reason: str = "") -> ModelVersion:
        """Register a version in Staging (mandatory dataset version); idempotent for the same digest."""
        mv = fields if isinstance(fields, ModelVersion) else version_from_fields(fields)
        self.refresh()
        self._commit(self.state.register(mv, actor or default_actor(), reason))
        return mv

    def promote(self, name: str, version: str, to: Stage | str, actor: str | None = None, reason: str = "",
                *, force: bool = False) -> ModelEvent:
        self.refresh()
        stage = to if isinstance(to, Stage) else parse_stage(to)
        return self._commit(self.state.promote(name, version, stage, actor or default_actor(), reason, force=force))[0]

    def archive(self, name: str, version: str, actor: str | None = None, reason: str = "", *, force: bool = False) -> ModelEvent:
        return self.promote(name, version, Stage.ARCHIVED, actor, reason, force=force)

    def rollback(self, name: str, actor: str | None = None, reason: str = "") -> ModelEvent:
        self.refresh()
        return self._commit(self.state.rollback(name, actor or default_actor(), reason))[0]

    def set_canary(self, name: str, share: float, actor: str | None = None, reason: str = "") -> ModelEvent:
        self.refresh()
        return self._commit(self.state.set_canary(name, share, actor or default_actor(), reason))[0]

    def canary_rollback(self, name: str, actor: str | None, reason: str, verdict: dict[str, Any]) -> ModelEvent:
        self.refresh()
        return self._commit(self.state.canary_rollback(name, actor or default_actor(), reason, verdict))[0]

    def record_shadow(self, name: str, version: str, events: int, metric: str, challenger: float,
                      production: float | None, actor: str | None = None, reason: str = "") -> ModelEvent:
        self.refresh()
        return self._commit(self.state.record_shadow(name, version, events, metric, challenger, production,
                                                     actor or default_actor(), reason))[0]

    def set_policy(self, name: str, policy: ModelPolicy | dict[str, Any], actor: str | None = None,
                   reason: str = "") -> ModelEvent:
        self.refresh()
        p = policy if isinstance(policy, ModelPolicy) else ModelPolicy.model_validate(policy)
        return self._commit(self.state.set_policy(name, p, actor or default_actor(), reason))[0]

    def close(self) -> None:
        self.topic.close()


def parse_stage(text: str) -> Stage:
    """A stage from its name, any case (``production``, ``Production``)."""
    for stage in Stage:
        if stage.value.lower() == text.strip().lower():
            return stage
    raise ModelRegistryError(f"unknown stage {text!r}; stages are {', '.join(s.value for s in Stage)}")
