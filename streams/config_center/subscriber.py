"""The live config that processors embed: changes applied within a second, no restart.

``ConfigSubscriber(stack.kafka, name="rules", namespaces=["business-rule", "feature-switch"])``
follows ``_tangram.config`` in a background thread. Processors read values with ``get`` (by
entity, for scoped values) on their hot path — a dictionary lookup under a lock — and may
register ``on_change`` callbacks (called in the subscriber's thread) for changes that touch
their namespaces. A restarted processor replays the topic and starts from the latest version.

Metrics: ``tangram_config_version{subscriber}`` (the version it runs),
``tangram_config_changes_total{subscriber,outcome}`` and ``tangram_config_propagation_seconds``
(change written → applied here). ``status()`` reports the same for status pages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from streams.config_center.center import CONFIG_TOPIC
from streams.config_center.schemas import DEFAULT_SCHEMAS, ConfigSchemas
from streams.config_center.state import AppliedChange, ConfigState
from streams.errors import ConfigCenterError
from streams.security.kafka import KafkaConnection
from streams.statelog import Follows, LogRecord, TopicFollower

log = logging.getLogger("tangram.config.subscriber")

VERSION = Gauge("tangram_config_version", "The config version this processor runs.", ["subscriber"])
CHANGES = Counter("tangram_config_changes_total", "Config changes seen, by outcome (applied, rejected).",
                  ["subscriber", "outcome"])
PROPAGATION = Histogram("tangram_config_propagation_seconds", "From a config change being written to it being applied.",
                        ["subscriber"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

Listener = Callable[[AppliedChange], None]


class ConfigSubscriber(Follows):
    """Live, validated, versioned view of the config center for one processor."""

    def __init__(self, kafka: KafkaConnection, topic: str = CONFIG_TOPIC, *, name: str,
                 namespaces: Iterable[str] | None = None, schemas: ConfigSchemas = DEFAULT_SCHEMAS,
                 timeout_s: float = 10.0) -> None:
        self.name = name
        self.namespaces = frozenset(namespaces) if namespaces is not None else None
        self.state = ConfigState(schemas=schemas)
        self.applied_ms = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._listeners: list[Listener] = []
        self._follower = TopicFollower(kafka, topic, self._on_record, name=f"config-{name}",
                                       timeout_s=timeout_s)
        VERSION.labels(name).set(0)

    def on_change(self, listener: Listener) -> None:
        """Call ``listener(applied)`` after each applied change that touches this subscriber's namespaces."""
        self._listeners.append(listener)

    @property
    def version(self) -> int:
        return self.state.version

    def get(self, namespace: str, key: str, default: Any = None, entity: str | None = None) -> Any:
        """The value now (a copy), for ``entity`` when scoped values exist."""
        with self._lock:
            return self.state.get(namespace, key, entity, default)

    def namespace(self, namespace: str, entity: str | None = None) -> dict[str, Any]:
        with self._lock:
            return self.state.namespace(namespace, entity)

    def wait_version(self, version: int, timeout_s: float) -> int:
        """Block until this subscriber runs ``version`` or later; ConfigCenterError past the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.state.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConfigCenterError(f"subscriber {self.name} is at config version {self.state.version}, "
                                            f"not {version}, after {timeout_s}s")
                self._changed.wait(left)
            return self.state.version

    def status(self) -> dict[str, Any]:
        """What a status page shows: the version run, since when, and whether it is caught up."""
        with self._lock:
            return {"subscriber": self.name, "version": self.state.version, "applied_ms": self.applied_ms,
                    "caught_up": self._follower.caught_up, "rejected": len(self.state.rejected),
                    "namespaces": sorted(self.namespaces) if self.namespaces else "all"}

    def _on_record(self, record: LogRecord) -> None:
        with self._changed:
            rejected_before = len(self.state.rejected)
            result = self.state.apply_record(record)
            if len(self.state.rejected) > rejected_before:
                change, why = self.state.rejected[-1]
                CHANGES.labels(self.name, "rejected").inc()
                log.warning("%s: config change %s by %s not applied: %s", self.name, change.id, change.author, why)
            if not isinstance(result, AppliedChange):
                return
            self.applied_ms = int(time.time() * 1000)
            self._changed.notify_all()
        VERSION.labels(self.name).set(result.version)
        CHANGES.labels(self.name, "applied").inc()
        PROPAGATION.labels(self.name).observe(max(0.0, self.applied_ms - result.change.at_ms) / 1000)
        touched = {d.namespace for d in result.diff}
        if self.namespaces is None or touched & self.namespaces:
            for listener in self._listeners:
                try:
                    listener(result)
                except Exception:  # a processor's callback bug must not stop the live push
                    log.exception("%s: config listener failed on version %d", self.name, result.version)

