"""The model registry's state: a pure fold of the events on ``_tangram.models``.

Nothing here touches Kafka. Every change is an :class:`ModelEvent`; :class:`ModelRegistryState`
methods that change something validate against the current state and *return* the events to
append; the caller appends them and only then applies them, exactly as a replay or a live
watcher does, so the writer's state and every reader's state cannot diverge (the same pattern
as ``streams/registry/store.py``).

Stages (the seeds' node 7): ``Staging → Challenger → Production → Archived``.

* a new version is registered in **Staging** (a ``dataset_version`` is mandatory);
* **Challenger** is scored in shadow, then takes a canary share of the traffic;
* **Production** serves the traffic; promoting a new one archives the old one and remembers
  it, so ``rollback`` can bring it back;
* **Archived** versions keep their metadata for audit.

Challenger → Production passes the model's admission rule (N shadow-scored events and a metric
no worse than Production's by a declared margin) unless forced, and the verdict is recorded
with the transition.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from streams.errors import ModelRegistryError
from streams.statelog import LogRecord, entity_share

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Stage(str, Enum):
    STAGING = "Staging"
    CHALLENGER = "Challenger"
    PRODUCTION = "Production"
    ARCHIVED = "Archived"


#: Stage changes ``promote``/``archive`` may make (rollback and canary rollback are their own events).
ALLOWED: dict[Stage, frozenset[Stage]] = {
    Stage.STAGING: frozenset({Stage.CHALLENGER, Stage.PRODUCTION, Stage.ARCHIVED}),
    Stage.CHALLENGER: frozenset({Stage.PRODUCTION, Stage.STAGING, Stage.ARCHIVED}),
    Stage.PRODUCTION: frozenset({Stage.ARCHIVED}),
    Stage.ARCHIVED: frozenset({Stage.STAGING}),
}


class TensorSchema(_Frozen):
    """One input or output tensor of a model."""

    name: str
    dtype: str = Field(description="Triton data type, e.g. FP32.")
    shape: list[int] = Field(description="Dimensions without the batch dimension.")
    names: list[str] = Field(default_factory=list, description="Column names (features, classes), if any.")


class ModelVersion(_Frozen):
    """What registration records about one version of a model (immutable afterwards)."""

    name: str = Field(pattern=NAME_PATTERN)
    version: str = Field(pattern=NAME_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Digest of the artifact; checked before every load.")
    artifact: str = Field(min_length=1, description="Artifact path, relative to the model repository or absolute.")
    framework: str = Field(min_length=1)
    inputs: list[TensorSchema] = Field(default_factory=list)
    outputs: list[TensorSchema] = Field(default_factory=list)
    owner: str = Field(min_length=1)
    license: str = Field(min_length=1)
    dataset_version: str = Field(min_length=1, description="Mandatory: the data the model was trained on.")
    training_metrics: dict[str, float] = Field(default_factory=dict)
    evaluation: dict[str, Any] = Field(default_factory=dict, description="Evaluation report.")
    description: str = ""


class AdmissionRule(_Frozen):
    """What Challenger → Production needs (the seeds' stage admission conditions)."""

    min_shadow_events: int = Field(1000, ge=0, description="Shadow-scored events the challenger must have.")
    metric: str = Field("accuracy", description="Metric compared between challenger and production.")
    higher_is_better: bool = True
    margin: float = Field(0.0, ge=0, description="How much worse than production the challenger may be.")


class CanarySchedule(_Frozen):
    """The canary's share schedule and health bound (seeds: 1 %, +5 % per interval, p50 −5 % → rollback).

    What ends a canary (the canary job, ``streams.lifecycle.canary_job``, applies it): a health
    verdict worse than ``max_confidence_p50_drop`` rolls it back at any share; at ``max_share``,
    after one more healthy ``interval_s``, ``promote: auto`` makes the challenger Production when the
    model's admission rule passes (``manual``: it stays there until an operator promotes it).
    """

    initial_share: float = Field(0.01, gt=0, le=1)
    step: float = Field(0.05, gt=0, le=1)
    interval_s: float = Field(600.0, gt=0)
    max_share: float = Field(0.5, gt=0, le=1, description="The canary never grows past this share by itself.")
    min_events: int = Field(100, ge=1, description="Events per arm before the health is judged.")
    max_confidence_p50_drop: float = Field(0.05, ge=0, lt=1, description="Relative drop of confidence p50 that rolls back.")
    start: Literal["auto", "manual"] = Field(
        "auto", description="auto: the canary job starts the canary as soon as there is a Challenger; manual: the "
                            "Challenger stays in shadow until an operator sets a share (`tangram models canary`).")
    promote: Literal["auto", "manual"] = Field(
        "auto", description="auto: at max_share, healthy for one more interval and passing the admission rule, the "
                            "canary job promotes the Challenger to Production; manual: an operator does.")


class ModelPolicy(_Frozen):
    admission: AdmissionRule = AdmissionRule()
    canary: CanarySchedule = CanarySchedule()


EventType = Literal["registered", "transition", "rollback", "canary", "canary-rollback", "shadow-evidence", "policy"]


class ModelEvent(_Frozen):
    """One recorded change: who, when, why, and what."""

    id: str
    type: EventType
    model: str
    version: str | None = None
    actor: str
    at_ms: int
    reason: str = ""
    data: dict[str, Any] = Field(default_factory=dict)

    def record(self) -> LogRecord:
        return LogRecord({"kind": "model-event", "model": self.model, "id": self.id}, self.model_dump(mode="json"))

    def summary(self) -> str:
        d = self.data
        match self.type:
            case "registered":
                return f"registered {self.version} (dataset {d['record']['dataset_version']})"
            case "transition":
                return f"{self.version}: {d['from']} → {d['to']}" + (f" (replaces {d['replaces']})" if d.get("replaces") else "")
            case "rollback":
                return f"rollback: {d['from']} → {d['to']}"
            case "canary":
                return f"{self.version}: canary share {d['share']:.0%}"
            case "canary-rollback":
                verdict = d.get("verdict") or {}
                detail = verdict.get("detail", "") if isinstance(verdict, dict) else str(verdict)
                return f"{self.version}: canary rolled back at {d.get('share', 0):.0%}" + (f" ({detail})" if detail else "")
            case "shadow-evidence":
                return (f"{self.version}: +{d['events']} shadow events, {d['metric']} {_num(d['challenger'])} "
                        f"vs {_num(d['production'])}")
            case _:
                return "policy set"


class VersionRef(_Frozen):
    """What a worker needs to load a version."""

    version: str
    sha256: str
    artifact: str
    framework: str


class Routing(_Frozen):
    """Which versions of a model the inference workers serve, as the registry says now."""

    model: str
    production: VersionRef | None = None
    challenger: VersionRef | None = None
    canary_share: float = 0.0
    shadow: bool = False
    #: The version ``rollback`` would serve (the previous Production): a worker that keeps it loaded
    #: makes a rollback a routing switch, without a model load on the way back.
    standby: VersionRef | None = None
    revision: int = 0
    updated_ms: int = 0

    def serving(self, entity: str) -> VersionRef | None:
        """The version that serves ``entity``: the challenger for the canary share of entities, else production.

        The split is by a stable hash of the entity key, so a device stays on one version; it is the
        hash the inference worker splits by (``inference_workers.routing.key_bucket``), unsalted, so
        this answer and the worker's agree.
        """
        if self.challenger is not None and self.canary_share > 0 and entity_share(entity) < self.canary_share:
            return self.challenger
        return self.production


@dataclass
class ShadowEvidence:
    events: int = 0
    metric: str = ""
    challenger: float | None = None
    production: float | None = None


@dataclass
class ModelState:
    """Everything the registry knows about one model."""

    name: str
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    stages: dict[str, Stage] = field(default_factory=dict)
    policy: ModelPolicy = field(default_factory=ModelPolicy)
    production_history: list[str] = field(default_factory=list)  # the current Production is last
    canary_share: float = 0.0
    evidence: dict[str, ShadowEvidence] = field(default_factory=dict)
    events: list[ModelEvent] = field(default_factory=list)

    def in_stage(self, stage: Stage) -> str | None:
        return next((v for v, s in self.stages.items() if s is stage), None)

    @property
    def production(self) -> str | None:
        return self.in_stage(Stage.PRODUCTION)

    @property
    def challenger(self) -> str | None:
        return self.in_stage(Stage.CHALLENGER)

    def previous_production(self) -> str | None:
        """The version ``rollback`` brings back: the latest earlier Production that is not the current one."""
        current = self.production
        return next((v for v in reversed(self.production_history[:-1]) if v != current and v in self.versions), None)

    def ref(self, version: str | None) -> VersionRef | None:
        if version is None:
            return None
        mv = self.versions[version]
        return VersionRef(version=version, sha256=mv.sha256, artifact=mv.artifact, framework=mv.framework)

    def routing(self) -> Routing:
        challenger = self.challenger
        return Routing(
            model=self.name,
            production=self.ref(self.production),
            challenger=self.ref(challenger),
            canary_share=self.canary_share if challenger else 0.0,
            shadow=challenger is not None and self.canary_share == 0,
            standby=self.ref(self.previous_production()),
            revision=len(self.events),
            updated_ms=self.events[-1].at_ms if self.events else 0,
        )


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def now_ms() -> int:
    return int(time.time() * 1000)


class ModelRegistryState:
    """All models, folded from events. ``apply`` is total: it never raises on a well-formed event."""

    def __init__(self) -> None:
        self.models: dict[str, ModelState] = {}
        self._seen: set[str] = set()

    # ---- applying events ----------------------------------------------------------------

    def apply_record(self, record: LogRecord) -> ModelEvent | None:
        """Apply one log record; returns the event, or None for records that are not model events."""
        if record.key.get("kind") != "model-event" or record.value is None:
            return None
        try:
            event = ModelEvent.model_validate(record.value)
        except ValidationError:
            return None
        return event if self.apply(event) else None

    def apply(self, event: ModelEvent) -> bool:
        """Apply one event; False if it was already applied (a retried append)."""
        if event.id in self._seen:
            return False
        self._seen.add(event.id)
        m = self.models.setdefault(event.model, ModelState(event.model))
        d, v = event.data, event.version
        if event.type == "registered":
            m.versions[v] = ModelVersion.model_validate(d["record"])
            m.stages[v] = Stage.STAGING
        elif event.type == "transition":
            to = Stage(d["to"])
            if to is Stage.PRODUCTION:
                old = m.production
                if old is not None and old != v:
                    m.stages[old] = Stage.ARCHIVED
                m.production_history.append(v)
            if m.stages.get(v) is Stage.CHALLENGER and to is not Stage.CHALLENGER:
                m.canary_share = 0.0
            if to is Stage.CHALLENGER:
                m.canary_share = 0.0
                m.evidence.pop(v, None)
            if m.stages.get(v) is Stage.PRODUCTION and to is not Stage.PRODUCTION and m.production_history[-1:] == [v]:
                m.production_history.pop()
            m.stages[v] = to
        elif event.type == "rollback":
            m.stages[d["from"]] = Stage.ARCHIVED
            m.stages[d["to"]] = Stage.PRODUCTION
            if m.production_history[-1:] == [d["from"]]:
                m.production_history.pop()
            if m.production_history[-1:] != [d["to"]]:
                m.production_history.append(d["to"])
        elif event.type == "canary":
            m.canary_share = float(d["share"])
        elif event.type == "canary-rollback":
            m.canary_share = 0.0
            m.stages[v] = Stage.STAGING
        elif event.type == "shadow-evidence":
            ev = m.evidence.setdefault(v, ShadowEvidence())
            ev.events += int(d["events"])
            ev.metric = d["metric"]
            ev.challenger = float(d["challenger"])
            ev.production = None if d.get("production") is None else float(d["production"])
        elif event.type == "policy":
            m.policy = ModelPolicy.model_validate(d["policy"])
        m.events.append(event)
        return True

    # ---- queries ------------------------------------------------------------------------

    def model(self, name: str) -> ModelState:
        if name not in self.models or not self.models[name].versions:
            known = ", ".join(sorted(self.models)) or "none"
            raise ModelRegistryError(f"model {name!r} is not registered (registered: {known}); "
                                     "register it first with `tangram models register`")
        return self.models[name]

    def version(self, name: str, version: str) -> ModelVersion:
        m = self.model(name)
        if version not in m.versions:
            raise ModelRegistryError(f"model {name!r} has no version {version!r} (it has {', '.join(m.versions)})")
        return m.versions[version]

    def routing(self, name: str) -> Routing:
        return self.models[name].routing() if name in self.models else Routing(model=name)

    # ---- changes: return the events to append -------------------------------------------

    def register(self, mv: ModelVersion, actor: str, reason: str = "") -> list[ModelEvent]:
        """Register a version in Staging; nothing if the same version with the same digest exists."""
        existing = self.models.get(mv.name, ModelState(mv.name)).versions.get(mv.version)
        if existing is not None:
            if existing.sha256 == mv.sha256:
                return []
            raise ModelRegistryError(
                f"{mv.name} version {mv.version} is already registered with digest {existing.sha256[:12]}…, "
                f"not {mv.sha256[:12]}…; a version is immutable: register the new artifact as a new version")
        return [_event("registered", mv.name, mv.version, actor, reason, record=mv.model_dump(mode="json"))]

    def promote(self, name: str, version: str, to: Stage, actor: str, reason: str, *, force: bool = False) -> list[ModelEvent]:
        """Move a version to another stage, checking the allowed moves and the admission rule."""
        m = self.model(name)
        self.version(name, version)
        current = m.stages[version]
        if current is to:
            raise ModelRegistryError(f"{name} {version} is already {to.value}")
        if to not in ALLOWED[current]:
            allowed = ", ".join(s.value for s in sorted(ALLOWED[current], key=list(Stage).index))
            raise ModelRegistryError(f"{name} {version} is {current.value}; from there it can go to {allowed}, "
                                     f"not {to.value}")
        data: dict[str, Any] = {"from": current.value, "to": to.value}
        if to is Stage.CHALLENGER and m.challenger is not None:
            raise ModelRegistryError(f"{name} already has a challenger ({m.challenger}); archive it or move it "
                                     "back to Staging first")
        if to is Stage.PRODUCTION:
            production = m.production
            if production is not None:
                data["replaces"] = production
                if current is not Stage.CHALLENGER and not force:
                    raise ModelRegistryError(f"{name} {version} must be Challenger (shadow, canary) before it "
                                             f"replaces Production {production}; use --force to skip that")
                verdict = admission(m, version)
                data["admission"] = verdict
                if not verdict["passed"]:
                    if not force:
                        raise ModelRegistryError(f"{name} {version} does not pass the admission rule: "
                                                 f"{verdict['detail']} (use --force with a reason to override)")
                    data["forced"] = True
        if current is Stage.PRODUCTION and to is Stage.ARCHIVED and not force:
            raise ModelRegistryError(f"{name} {version} is Production; archiving it leaves the model with nothing "
                                     "to serve: promote another version or `rollback`, or use --force")
        return [_event("transition", name, version, actor, reason, **data)]

    def rollback(self, name: str, actor: str, reason: str) -> list[ModelEvent]:
        """Make the previous Production version current again; the current one is archived."""
        m = self.model(name)
        current = m.production
        if current is None:
            raise ModelRegistryError(f"{name} has no Production version to roll back from")
        previous = m.previous_production()
        if previous is None:
            raise ModelRegistryError(f"{name} has no earlier Production version to roll back to "
                                     f"(production history: {', '.join(m.production_history)})")
        return [_event("rollback", name, previous, actor, reason, **{"from": current, "to": previous})]

    def set_canary(self, name: str, share: float, actor: str, reason: str) -> list[ModelEvent]:
        """Give the challenger ``share`` of the entities (0 = back to shadow only)."""
        m = self.model(name)
        if m.challenger is None:
            raise ModelRegistryError(f"{name} has no Challenger to canary; promote a version to Challenger first")
        if not 0.0 <= share <= 1.0:
            raise ModelRegistryError(f"a canary share is between 0 and 1, not {share}")
        return [_event("canary", name, m.challenger, actor, reason, share=share, previous=m.canary_share)]

    def canary_rollback(self, name: str, actor: str, reason: str, verdict: dict[str, Any]) -> list[ModelEvent]:
        """Take the canary out of the traffic (back to Staging), recording the health verdict."""
        m = self.model(name)
        if m.challenger is None:
            raise ModelRegistryError(f"{name} has no Challenger in canary")
        return [_event("canary-rollback", name, m.challenger, actor, reason, share=m.canary_share, verdict=verdict)]

    def record_shadow(self, name: str, version: str, events: int, metric: str, challenger: float,
                      production: float | None, actor: str, reason: str = "") -> list[ModelEvent]:
        """Record evidence from shadow scoring: events scored and the metric of both arms."""
        m = self.model(name)
        if m.stages.get(version) is not Stage.CHALLENGER:
            raise ModelRegistryError(f"{name} {version} is not the Challenger; shadow evidence is for the Challenger")
        if events < 0:
            raise ModelRegistryError("shadow evidence counts events: a number >= 0")
        return [_event("shadow-evidence", name, version, actor, reason, events=events, metric=metric,
                       challenger=challenger, production=production)]

    def set_policy(self, name: str, policy: ModelPolicy, actor: str, reason: str = "") -> list[ModelEvent]:
        self.model(name)
        return [_event("policy", name, None, actor, reason, policy=policy.model_dump(mode="json"))]


def admission(m: ModelState, version: str) -> dict[str, Any]:
    """The admission rule's verdict for ``version`` replacing the current Production."""
    return admission_verdict(m.policy.admission, m.evidence.get(version, ShadowEvidence()))


def admission_verdict(rule: AdmissionRule, ev: ShadowEvidence) -> dict[str, Any]:
    """The verdict of ``rule`` on evidence ``ev`` (also used on evidence about to be recorded)."""
    base = {"rule": rule.model_dump(mode="json"), "events": ev.events, "metric": ev.metric,
            "challenger": ev.challenger, "production": ev.production}
    if ev.events < rule.min_shadow_events:
        return {**base, "passed": False,
                "detail": f"needs {rule.min_shadow_events} shadow-scored events, has {ev.events}"}
    if ev.metric != rule.metric or ev.challenger is None or ev.production is None:
        return {**base, "passed": False,
                "detail": f"no shadow measurement of {rule.metric!r} for both challenger and production"}
    worse_by = (ev.production - ev.challenger) if rule.higher_is_better else (ev.challenger - ev.production)
    passed = worse_by <= rule.margin + 1e-12
    detail = (f"{rule.metric} {ev.challenger:.4f} vs production {ev.production:.4f} "
              f"({'within' if passed else 'beyond'} the margin {rule.margin})")
    return {**base, "passed": passed, "detail": detail}


def _event(type_: EventType, model: str, version: str | None, actor: str, reason: str, **data: Any) -> ModelEvent:
    return ModelEvent(id=uuid.uuid4().hex, type=type_, model=model, version=version, actor=actor,
                      at_ms=now_ms(), reason=reason, data=data)


def version_from_fields(fields: dict[str, Any]) -> ModelVersion:
    """Build a :class:`ModelVersion`, refusing a missing dataset version first and by name."""
    if not str(fields.get("dataset_version") or "").strip():
        name = f"{fields.get('name', '?')} {fields.get('version', '?')}"
        raise ModelRegistryError(
            f"registration of {name} refused: dataset_version is mandatory. Say which data the model was trained "
            "on (`--dataset-version 20240501`, or `dataset_version` in model_card.json), so a model is never "
            "retrained or compared on the wrong data unnoticed.")
    try:
        return ModelVersion.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}" for e in exc.errors())
        raise ModelRegistryError(f"registration refused: {problems}") from None
