"""The config center's state: a pure fold of the changes on ``_tangram.config``.

A :class:`ConfigChange` is one atomic, versioned change: one or more operations (set or delete
a value, optionally for a scope), with its author, time and reason, and the version it was
made against (``base_version``). Folding it:

* if ``base_version`` is not the current version, another change landed first: the change is
  *rejected as a conflict* — the writer sees that and retries on the new state;
* every value is validated against its namespace's schema: one invalid value rejects the
  whole change, nothing of it is applied;
* otherwise every operation is applied, the version goes up by one and the diff (before/after
  of every cell that changed) is recorded with the change.

Every reader folds the same records in the same order with the same rules, so all of them
hold the same version and values. Nothing here touches Kafka.

Scoped values (config canaries): a value can be set for a *scope* — entities whose key starts
with a prefix, or a stable hash share of entities — beside the key's default. ``get(…, entity)``
returns the first scoped value whose scope matches, else the default.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streams.config_center.schemas import DEFAULT_SCHEMAS, ConfigSchemas
from streams.errors import ConfigCenterError, ConfigValidationError
from streams.statelog import LogRecord, entity_share


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Scope(_Frozen):
    """Which entities a scoped value applies to: a key prefix, or a stable hash share."""

    prefix: str | None = Field(None, min_length=1)
    share: float | None = Field(None, gt=0, le=1)
    salt: str = Field("", description="Varies which entities fall in a share.")

    @model_validator(mode="after")
    def _exactly_one(self) -> Scope:
        if (self.prefix is None) == (self.share is None):
            raise ValueError("a scope has exactly one of `prefix` or `share`")
        return self

    def matches(self, entity: str) -> bool:
        if self.prefix is not None:
            return entity.startswith(self.prefix)
        return entity_share(entity, self.salt) < (self.share or 0.0)

    @property
    def label(self) -> str:
        if self.prefix is not None:
            return f"prefix={self.prefix}"
        return f"share={self.share:g}" + (f",salt={self.salt}" if self.salt else "")


class ConfigOp(_Frozen):
    """Set (or delete) one value of ``namespace/key``: its default (no scope) or its value for a scope."""

    namespace: str
    key: str
    value: Any = None
    delete: bool = False
    scope: Scope | None = None


class ConfigChange(_Frozen):
    id: str
    base_version: int = Field(ge=0)
    author: str = Field(min_length=1)
    at_ms: int
    reason: str = ""
    ops: list[ConfigOp] = Field(min_length=1)
    restored_from: str | None = None

    def record(self) -> LogRecord:
        return LogRecord({"kind": "config-change", "id": self.id}, self.model_dump(mode="json"))


class DiffLine(_Frozen):
    """One cell that differs: ``kind`` added / changed / removed, with the values before and after."""

    namespace: str
    key: str
    scope: str = ""
    kind: Literal["added", "changed", "removed"]
    before: Any = None
    after: Any = None

    def text(self) -> str:
        where = f"{self.namespace}/{self.key}" + (f" [{self.scope}]" if self.scope else "")
        if self.kind == "added":
            return f"+ {where} = {self.after!r}"
        if self.kind == "removed":
            return f"- {where} (was {self.before!r})"
        return f"~ {where}: {self.before!r} → {self.after!r}"


class AppliedChange(_Frozen):
    """A change as applied: the version it made, and its diff."""

    version: int
    change: ConfigChange
    diff: list[DiffLine]


class Snapshot(_Frozen):
    """The whole configuration at a version, saved under a name."""

    name: str = Field(min_length=1)
    version: int
    author: str
    at_ms: int
    reason: str = ""
    cells: list[dict[str, Any]]

    def record(self) -> LogRecord:
        return LogRecord({"kind": "config-snapshot", "name": self.name}, self.model_dump(mode="json"))


@dataclass
class Cell:
    scope: Scope | None
    value: Any


CellKey = tuple[str, str, str]  # namespace, key, scope label ("" = the default)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class ConfigState:
    """Every namespace's values, the version, the history and the snapshots."""

    schemas: ConfigSchemas = field(default_factory=lambda: DEFAULT_SCHEMAS)
    version: int = 0
    entries: dict[tuple[str, str], dict[str, Cell]] = field(default_factory=dict)
    history: list[AppliedChange] = field(default_factory=list)
    rejected: list[tuple[ConfigChange, str]] = field(default_factory=list)
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)

    # ---- applying records ----------------------------------------------------------------

    def apply_record(self, record: LogRecord) -> AppliedChange | Snapshot | None:
        """Apply one log record: a change (returns it if applied), a snapshot, or something else (None)."""
        kind = record.key.get("kind")
        if record.value is None:
            return None
        try:
            if kind == "config-change":
                return self.apply(ConfigChange.model_validate(record.value))
            if kind == "config-snapshot":
                snapshot = Snapshot.model_validate(record.value)
                self.snapshots[snapshot.name] = snapshot
                return snapshot
        except ValidationError:
            return None
        return None

    def apply(self, change: ConfigChange) -> AppliedChange | None:
        """Apply a change; None if it was seen before or is rejected (conflict or invalid: see ``rejected``)."""
        if change.id in self._seen:
            return None
        self._seen.add(change.id)
        if change.base_version != self.version:
            self.rejected.append((change, f"conflict: made against version {change.base_version}, "
                                          f"but version {self.version} was current"))
            return None
        try:
            values = [None if op.delete else self.schemas.validate(op.namespace, op.key, op.value) for op in change.ops]
        except ConfigValidationError as exc:
            self.rejected.append((change, f"invalid: {exc}"))
            return None
        before = self.cells()
        for op, value in zip(change.ops, values):
            entry = self.entries.setdefault((op.namespace, op.key), {})
            label = op.scope.label if op.scope else ""
            if op.delete:
                entry.pop(label, None)
            else:
                entry[label] = Cell(op.scope, value)
            if not entry:
                del self.entries[(op.namespace, op.key)]
        self.version += 1
        applied = AppliedChange(version=self.version, change=change, diff=diff_cells(before, self.cells()))
        self.history.append(applied)
        return applied

    # ---- queries ---------------------------------------------------------------------------

    def get(self, namespace: str, key: str, entity: str | None = None, default: Any = None) -> Any:
        """The value of ``namespace/key`` for ``entity``: its first matching scoped value, else the default."""
        entry = self.entries.get((namespace, key))
        if not entry:
            return default
        if entity is not None:
            for cell in entry.values():
                if cell.scope is not None and cell.scope.matches(entity):
                    return copy.deepcopy(cell.value)
        cell = entry.get("")
        return default if cell is None else copy.deepcopy(cell.value)

    def namespace(self, namespace: str, entity: str | None = None) -> dict[str, Any]:
        """Every key of a namespace with its value for ``entity`` (keys with only scoped values may be absent)."""
        out = {}
        for (ns, key) in self.entries:
            if ns == namespace:
                value = self.get(ns, key, entity, _MISSING)
                if value is not _MISSING:
                    out[key] = value
        return out

    def cells(self) -> dict[CellKey, Any]:
        """Every stored value by (namespace, key, scope label)."""
        return {(ns, key, label): cell.value for (ns, key), entry in self.entries.items() for label, cell in entry.items()}

    def scopes(self) -> dict[CellKey, Scope | None]:
        return {(ns, key, label): cell.scope for (ns, key), entry in self.entries.items() for label, cell in entry.items()}

    def at(self, version: int) -> ConfigState:
        """The state as it was at ``version`` (re-folded from the history)."""
        if not 0 <= version <= self.version:
            raise ConfigCenterError(f"version {version} does not exist; versions run from 0 to {self.version}")
        past = ConfigState(schemas=self.schemas)
        for applied in self.history[:version]:
            past.apply(applied.change)
        return past

    def changes_of(self, namespace: str | None = None, key: str | None = None) -> list[AppliedChange]:
        """The history, optionally only the changes that touched a namespace (and key)."""
        return [a for a in self.history
                if namespace is None or any(d.namespace == namespace and (key is None or d.key == key) for d in a.diff)
                or any(op.namespace == namespace and (key is None or op.key == key) for op in a.change.ops)]

    # ---- changes: return what to append ----------------------------------------------------

    def prepare(self, ops: list[ConfigOp], author: str, reason: str, restored_from: str | None = None) -> ConfigChange:
        """Validate every operation (all problems at once) and return the change to append."""
        if not ops:
            raise ConfigCenterError("a change needs at least one operation")
        problems = []
        for op in ops:
            if op.delete:
                label = op.scope.label if op.scope else ""
                if label not in self.entries.get((op.namespace, op.key), {}):
                    problems.append(f"{op.namespace}/{op.key}{f' [{label}]' if label else ''}: nothing to delete")
                continue
            try:
                self.schemas.validate(op.namespace, op.key, op.value)
            except ConfigValidationError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigValidationError("change refused, nothing was published: " + "; ".join(problems))
        change = ConfigChange(id=uuid.uuid4().hex, base_version=self.version, author=author, at_ms=now_ms(),
                              reason=reason, ops=ops, restored_from=restored_from)
        trial = ConfigState(schemas=self.schemas, version=self.version, entries=copy.deepcopy(self.entries))
        applied = trial.apply(change)
        if applied is not None and not applied.diff:
            raise ConfigCenterError("change refused: it would not change any value")
        return change

    def snapshot(self, name: str, author: str, reason: str = "") -> Snapshot:
        scopes = self.scopes()
        cells = [{"namespace": ns, "key": key, "scope": None if scopes[(ns, key, label)] is None
                  else scopes[(ns, key, label)].model_dump(mode="json"), "value": value}
                 for (ns, key, label), value in self.cells().items()]
        return Snapshot(name=name, version=self.version, author=author, at_ms=now_ms(), reason=reason, cells=cells)

    def restore_ops(self, target: ConfigState | Snapshot) -> list[ConfigOp]:
        """The operations that turn the current values into ``target``'s."""
        if isinstance(target, Snapshot):
            wanted = {(c["namespace"], c["key"], Scope.model_validate(c["scope"]).label if c["scope"] else ""):
                      (c["scope"], c["value"]) for c in target.cells}
        else:
            t_scopes = target.scopes()
            wanted = {k: (None if t_scopes[k] is None else t_scopes[k].model_dump(mode="json"), v)
                      for k, v in target.cells().items()}
        current, scopes = self.cells(), self.scopes()
        ops = [ConfigOp(namespace=ns, key=key, delete=True, scope=scopes[(ns, key, label)])
               for (ns, key, label) in current if (ns, key, label) not in wanted]
        ops += [ConfigOp(namespace=ns, key=key, value=value, scope=None if scope is None else Scope.model_validate(scope))
                for (ns, key, label), (scope, value) in wanted.items() if current.get((ns, key, label), _MISSING) != value]
        return ops

    def delete_ops(self, namespace: str, key: str) -> list[ConfigOp]:
        """The operations that remove ``namespace/key`` entirely: its default and every scoped value."""
        entry = self.entries.get((namespace, key))
        if not entry:
            raise ConfigCenterError(f"{namespace}/{key} has no value to delete")
        return [ConfigOp(namespace=namespace, key=key, delete=True, scope=cell.scope) for cell in entry.values()]


_MISSING = object()


def diff_cells(before: dict[CellKey, Any], after: dict[CellKey, Any]) -> list[DiffLine]:
    """What differs between two sets of cells, in a stable order."""
    lines = []
    for k in sorted(set(before) | set(after)):
        ns, key, scope = k
        if k not in before:
            lines.append(DiffLine(namespace=ns, key=key, scope=scope, kind="added", after=after[k]))
        elif k not in after:
            lines.append(DiffLine(namespace=ns, key=key, scope=scope, kind="removed", before=before[k]))
        elif before[k] != after[k]:
            lines.append(DiffLine(namespace=ns, key=key, scope=scope, kind="changed", before=before[k], after=after[k]))
    return lines
