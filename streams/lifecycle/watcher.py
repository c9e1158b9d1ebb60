"""The reader side that inference workers embed: live routing of every model.

``ModelRegistryWatcher(stack.kafka).start()`` follows ``_tangram.models`` in a background thread
(:class:`~streams.statelog.TopicFollower`); ``current(name)`` returns the
:class:`~streams.lifecycle.state.Routing` the registry says now — production, challenger,
canary share, shadow — and ``on_change`` callbacks fire when a model's routing changes (a
promote, a canary step, a rollback). ``verified_path`` resolves a version's artifact and checks
its sha256 before the caller loads it.

Metrics: ``tangram_models_routing_revision{watcher,model}`` (events applied) and
``tangram_models_routing_lag_seconds`` (event written → applied here).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Gauge, Histogram

from streams.errors import ModelRegistryError
from streams.security.kafka import KafkaConnection
from streams.lifecycle.artifacts import resolve_artifact, verify_artifact
from streams.lifecycle.registry import MODELS_TOPIC
from streams.lifecycle.state import ModelRegistryState, Routing, VersionRef
from streams.statelog import Follows, LogRecord, TopicFollower

log = logging.getLogger("tangram.lifecycle.watcher")

REVISION = Gauge("tangram_models_routing_revision", "Registry events applied for a model by this watcher.",
                 ["watcher", "model"])
LAG = Histogram("tangram_models_routing_lag_seconds", "From a registry event being written to a watcher applying it.",
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

Listener = Callable[[Routing, Routing], None]  # (before, after)


class ModelRegistryWatcher(Follows):
    """Live, read-only view of ``_tangram.models`` for processors."""

    def __init__(self, kafka: KafkaConnection, topic: str = MODELS_TOPIC, *, name: str = "watcher",
                 timeout_s: float = 10.0) -> None:
        self.name = name
        self.state = ModelRegistryState()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._listeners: list[Listener] = []
        self._follower = TopicFollower(kafka, topic, self._on_record, name=f"models-{name}",
                                       timeout_s=timeout_s)

    def on_change(self, listener: Listener) -> None:
        """Call ``listener(before, after)`` (in the watcher's thread) whenever a model's routing changes."""
        self._listeners.append(listener)

    def current(self, name: str) -> Routing:
        """The routing of ``name`` now (an empty Routing if the model is unknown)."""
        with self._lock:
            return self.state.routing(name)

    def wait_for(self, name: str, predicate: Callable[[Routing], bool], timeout_s: float) -> Routing:
        """Block until ``predicate(current(name))`` holds; ModelRegistryError past the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(routing := self.state.routing(name)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ModelRegistryError(f"watcher {self.name}: {name} did not reach the expected routing within "
                                             f"{timeout_s}s (now {routing.model_dump_json()})")
                self._changed.wait(left)
            return routing

    def verified_path(self, name: str, ref: VersionRef, repository: Path) -> Path:
        """The artifact file of ``ref`` after its sha256 was checked: never load an unverified file."""
        return verify_artifact(resolve_artifact(ref.artifact, repository), ref.sha256, model=name, version=ref.version)

    def _on_record(self, record: LogRecord) -> None:
        with self._changed:
            model = record.key.get("model", "")
            before = self.state.routing(model)
            event = self.state.apply_record(record)
            if event is None:
                return
            after = self.state.routing(model)
            self._changed.notify_all()
        REVISION.labels(self.name, model).set(after.revision)
        LAG.observe(max(0.0, time.time() - event.at_ms / 1000))
        if before.model_copy(update={"revision": 0, "updated_ms": 0}) != after.model_copy(update={"revision": 0, "updated_ms": 0}):
            log.info("%s: %s routing now production=%s challenger=%s canary=%.0f%% shadow=%s (%s)", self.name, model,
                     after.production and after.production.version, after.challenger and after.challenger.version,
                     after.canary_share * 100, after.shadow, event.summary())
            for listener in self._listeners:
                try:
                    listener(before, after)
                except Exception:  # a listener's bug must not stop the watcher
                    log.exception("%s: routing listener failed for %s", self.name, model)
