"""The config center on the compacted topic ``_tangram.config``: the writer side.

:class:`ConfigCenter` catches up with the topic, validates a change against the declared
schemas (refusing it whole, before anything is published, if any value is invalid), appends
it (idempotent producer, ``acks=all``, deadline) and reads the topic up to that record to
confirm the version it got — or to report that another change landed first.
"""

from __future__ import annotations

import logging
from typing import Any

from streams.config_center.schemas import DEFAULT_SCHEMAS, ConfigSchemas
from streams.config_center.state import AppliedChange, ConfigOp, ConfigState, DiffLine, Scope, Snapshot, diff_cells
from streams.errors import ConfigCenterError
from streams.security.kafka import KafkaConnection
from streams.statelog import Replica, StateTopic, default_actor

log = logging.getLogger("tangram.config")

CONFIG_TOPIC = "_tangram.config"


class ConfigCenter(Replica):
    """Set, read, diff, snapshot and restore configuration on ``_tangram.config``."""

    def __init__(self, kafka: KafkaConnection, topic: str = CONFIG_TOPIC, *, schemas: ConfigSchemas = DEFAULT_SCHEMAS,
                 timeout_s: float = 10.0) -> None:
        super().__init__(StateTopic(kafka, topic, timeout_s), ConfigState(schemas=schemas))

    def change(self, ops: list[ConfigOp], author: str | None = None, reason: str = "",
               restored_from: str | None = None) -> AppliedChange:
        """Publish one atomic change; returns it as applied (its version and diff)."""
        self.refresh()
        change = self.state.prepare(ops, author or default_actor(), reason, restored_from)
        self.topic.append([change.record()])
        self.refresh()
        applied = next((a for a in reversed(self.state.history) if a.change.id == change.id), None)
        if applied is None:
            why = next((r for c, r in self.state.rejected if c.id == change.id), "not found after writing")
            raise ConfigCenterError(f"change not applied ({why}); look at `tangram config history` and retry")
        log.info("config v%d by %s (%s): %s", applied.version, change.author, reason or "no reason",
                 "; ".join(d.text() for d in applied.diff))
        return applied

    def set(self, namespace: str, key: str, value: Any, author: str | None = None, reason: str = "",
            scope: Scope | None = None) -> AppliedChange:
        return self.change([ConfigOp(namespace=namespace, key=key, value=value, scope=scope)], author, reason)

    def delete(self, namespace: str, key: str, author: str | None = None, reason: str = "",
               scope: Scope | None = None) -> AppliedChange:
        """Delete one scoped value, or (no scope) the key with all its values."""
        self.refresh()
        ops = ([ConfigOp(namespace=namespace, key=key, delete=True, scope=scope)] if scope
               else self.state.delete_ops(namespace, key))
        return self.change(ops, author, reason)

    def get(self, namespace: str, key: str, entity: str | None = None, default: Any = None) -> Any:
        return self.refresh().get(namespace, key, entity, default)

    def snapshot(self, name: str, author: str | None = None, reason: str = "") -> Snapshot:
        """Save the current configuration under ``name`` (on the topic, next to the changes)."""
        snap = self.refresh().snapshot(name, author or default_actor(), reason)
        self.topic.append([snap.record()])
        self.refresh()
        return snap

    def resolve(self, target: str) -> ConfigState | Snapshot:
        """A snapshot name, or a version (``12`` or ``v12``), as something to diff or restore."""
        state = self.refresh()
        if target in state.snapshots:
            return state.snapshots[target]
        number = target.removeprefix("v")
        if number.isdigit():
            return state.at(int(number))
        raise ConfigCenterError(f"{target!r} is neither a snapshot ({', '.join(state.snapshots) or 'none saved'}) "
                                f"nor a version (0..{state.version})")

    def restore(self, target: str, author: str | None = None, reason: str = "") -> AppliedChange:
        """Make the values what they were in a snapshot or at a version, as one new change."""
        wanted = self.resolve(target)
        ops = self.state.restore_ops(wanted)
        if not ops:
            raise ConfigCenterError(f"the configuration already equals {target}")
        return self.change(ops, author, reason or f"restore {target}", restored_from=target)

    def diff(self, a: str, b: str | None = None) -> list[DiffLine]:
        """What differs from ``a`` to ``b`` (snapshot names or versions; ``b`` defaults to now)."""
        before = self._cells(self.resolve(a))
        after = self._cells(self.resolve(b)) if b is not None else self.refresh().cells()
        return diff_cells(before, after)

    @staticmethod
    def _cells(target: ConfigState | Snapshot) -> dict[tuple[str, str, str], Any]:
        if isinstance(target, ConfigState):
            return target.cells()
        return {(c["namespace"], c["key"], Scope.model_validate(c["scope"]).label if c["scope"] else ""): c["value"]
                for c in target.cells}

    def close(self) -> None:
        self.topic.close()
