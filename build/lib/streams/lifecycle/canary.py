"""Canary health, schedule and end: grow the canary's share step by step, roll it back when it is worse.

The seeds' rule: route 1 % to the new version, raise the share by 5 % per interval, and roll
back automatically when the canary's output confidence p50 is more than 5 % below the
baseline's. :func:`judge` is that rule as a pure function of the two arms' confidences;
:func:`decide` is the whole schedule as a pure function of the registry's state of a model and
the confidences seen (start, step, hold, roll back, promote); :class:`CanaryController` feeds on
scored predictions (version, confidence) and applies each decision to the registry, where it is
recorded with who, when and why. The canary job (``streams.lifecycle.canary_job``) runs a
controller inside the delivery loop, on the prediction topic.

What ends a canary:

* **rollback** — at any share, a verdict beyond ``max_confidence_p50_drop``: a ``canary-rollback``
  event carrying the verdict; the challenger goes back to Staging, every worker back to Production.
* **promotion** — at ``max_share``, healthy for one more ``interval_s``, when the schedule says
  ``promote: auto`` and the model's admission rule (Challenger → Production) passes. When that
  rule's metric is ``confidence_p50`` the controller first records the canary's own evidence (the
  challenger's canary-scored events and both arms' confidence p50); any other metric (accuracy
  from labelled outcomes, …) must be recorded by whoever measures it (``tangram models evidence``),
  and the canary waits at ``max_share`` until the rule passes. ``promote: manual`` always waits
  there for an operator (``tangram models promote NAME VERSION --to production``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from streams.errors import ModelRegistryError
from streams.lifecycle.state import CanarySchedule, ModelState, ShadowEvidence, Stage, admission_verdict

if TYPE_CHECKING:
    from streams.lifecycle.registry import ModelRegistry

log = logging.getLogger("tangram.lifecycle.canary")

#: The admission metric the canary measures itself: the challenger's confidence p50 against production's.
CONFIDENCE_P50 = "confidence_p50"


class Verdict(BaseModel):
    """The canary's health against the baseline (production) over the same period."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    healthy: bool | None  # None: not enough events yet
    baseline_events: int
    canary_events: int
    baseline_p50: float | None
    canary_p50: float | None
    drop: float | None  # relative drop of the canary's p50 below the baseline's
    detail: str


def judge(baseline: Iterable[float], canary: Iterable[float], schedule: CanarySchedule) -> Verdict:
    """Compare confidence p50 of the canary with the baseline's (the seeds' health signal)."""
    b, c = np.fromiter(baseline, float), np.fromiter(canary, float)
    if len(b) < schedule.min_events or len(c) < schedule.min_events:
        return Verdict(healthy=None, baseline_events=len(b), canary_events=len(c), baseline_p50=None,
                       canary_p50=None, drop=None,
                       detail=f"waiting for {schedule.min_events} events per arm (baseline {len(b)}, canary {len(c)})")
    bp, cp = float(np.median(b)), float(np.median(c))
    drop = (bp - cp) / bp if bp > 0 else 0.0
    healthy = drop <= schedule.max_confidence_p50_drop
    detail = (f"confidence p50 canary {cp:.4f} vs baseline {bp:.4f}: {drop:+.1%} drop "
              f"({'within' if healthy else 'beyond'} {schedule.max_confidence_p50_drop:.0%})")
    return Verdict(healthy=healthy, baseline_events=len(b), canary_events=len(c), baseline_p50=bp,
                   canary_p50=cp, drop=drop, detail=detail)


Action = Literal["start", "step", "hold", "rollback", "promote", "idle"]


class Evidence(BaseModel):
    """The canary's own admission evidence, recorded just before a promotion (metric ``confidence_p50``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    events: int
    challenger: float
    production: float


class Decision(BaseModel):
    """What the schedule says to do now, and why (the why is recorded with the registry event)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: Action
    reason: str
    verdict: Verdict | None = None
    share: float | None = None  # the new share, for start and step
    evidence: Evidence | None = None  # to record before promoting
    admission: dict[str, Any] | None = None


def last_share_change_ms(m: ModelState) -> int | None:
    """When the challenger's share last changed (its latest ``canary`` event), from the registry itself.

    The schedule's intervals count from there, so a restarted job keeps the pace of the one before.
    """
    for event in reversed(m.events):
        if event.version != m.challenger:
            continue
        if event.type == "canary":
            return event.at_ms
        if event.type == "transition" and event.data.get("to") == Stage.CHALLENGER.value:
            return None  # became Challenger after its last canary: a new canary
    return None


def decide(m: ModelState, arms: Mapping[str, Sequence[float]], *, now_ms: int, canary_events: int = 0) -> Decision:
    """The schedule's decision for model ``m`` given the confidences seen per version (``arms``).

    ``canary_events`` is how many canary-scored predictions of the challenger have been seen and not
    yet recorded as evidence; it becomes the evidence's event count when the admission metric is
    ``confidence_p50``. Pure: no I/O, the same state and inputs give the same decision.
    """
    challenger, production = m.challenger, m.production
    if challenger is None or production is None:
        return Decision(action="idle", reason=f"{m.name} has no Challenger and Production pair to compare")
    s = m.policy.canary
    share = m.canary_share
    if share <= 0:
        if s.start == "manual":
            return Decision(action="hold", reason=f"{challenger} in shadow; the schedule's start is manual: "
                                                  f"`tangram models canary {m.name} {s.initial_share:g}` starts it")
        return Decision(action="start", share=s.initial_share,
                        reason=f"canary start at {s.initial_share:.0%} (then +{s.step:.0%} every {s.interval_s:g}s "
                               f"while healthy, up to {s.max_share:.0%})")
    verdict = judge(arms.get(production, ()), arms.get(challenger, ()), s)
    if verdict.healthy is False:
        return Decision(action="rollback", verdict=verdict, reason=f"automatic at {share:.0%}: {verdict.detail}")
    if verdict.healthy is None:
        return Decision(action="hold", verdict=verdict, reason=verdict.detail)
    changed = last_share_change_ms(m)
    since_s = math.inf if changed is None else max(0.0, (now_ms - changed) / 1000)
    if since_s < s.interval_s:
        return Decision(action="hold", verdict=verdict,
                        reason=f"healthy at {share:.0%} for {since_s:.1f}s of {s.interval_s:g}s: {verdict.detail}")
    if share < s.max_share - 1e-9:
        new = round(min(s.max_share, share + s.step), 6)
        return Decision(action="step", verdict=verdict, share=new,
                        reason=f"healthy at {share:.0%} for {since_s:.0f}s: {verdict.detail}")
    if s.promote == "manual":
        return Decision(action="hold", verdict=verdict,
                        reason=f"at the schedule's max {share:.0%} and healthy ({verdict.detail}); promotion is manual: "
                               f"`tangram models promote {m.name} {challenger} --to production`")
    rule = m.policy.admission
    ev = m.evidence.get(challenger, ShadowEvidence())
    evidence = None
    if rule.metric == CONFIDENCE_P50:
        assert verdict.canary_p50 is not None and verdict.baseline_p50 is not None
        evidence = Evidence(events=canary_events, challenger=verdict.canary_p50, production=verdict.baseline_p50)
        ev = ShadowEvidence(ev.events + canary_events, CONFIDENCE_P50, evidence.challenger, evidence.production)
    admission = admission_verdict(rule, ev)
    if not admission["passed"]:
        return Decision(action="hold", verdict=verdict, admission=admission,
                        reason=f"at the schedule's max {share:.0%} and healthy; waiting for the admission rule: "
                               f"{admission['detail']}")
    return Decision(action="promote", verdict=verdict, evidence=evidence, admission=admission,
                    reason=f"canary complete: healthy at {share:.0%} for {since_s:.0f}s ({verdict.detail}); "
                           f"admission: {admission['detail']}")


class CanaryController:
    """Drives one model's canary from scored predictions.

    ``observe(version, confidence)`` for every prediction (production and challenger);
    ``tick()`` now and then: asks :func:`decide` on the registry's current state and applies the
    decision — starts the canary at the schedule's initial share, steps it up once per interval while
    it is healthy, rolls it back (recorded, with the verdict) when it is not, and promotes the
    challenger at the end of the schedule. Windows keep the last ``window`` confidences per arm.
    """

    def __init__(self, registry: ModelRegistry, model: str, *, actor: str = "canary-controller",
                 window: int = 5000, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.model = model
        self.actor = actor
        self.clock = clock
        self._arms: dict[str, deque[float]] = {}
        self._window = window
        self._seen: Counter[str] = Counter()  # predictions seen per version since the canary started
        self._recorded: Counter[str] = Counter()  # of which already recorded as evidence
        #: The last decision taken (its reason says why), for status and metrics.
        self.last: Decision | None = None

    def observe(self, version: str, confidence: float) -> None:
        self._arms.setdefault(version, deque(maxlen=self._window)).append(float(confidence))
        self._seen[version] += 1

    def observe_many(self, version: str, confidences: Iterable[float]) -> None:
        values = [float(c) for c in confidences]
        self._arms.setdefault(version, deque(maxlen=self._window)).extend(values)
        self._seen[version] += len(values)

    def decide(self) -> Decision:
        """The decision on the registry's current state (read first), without applying it."""
        m = self.registry.refresh().models.get(self.model)
        if m is None:
            return Decision(action="idle", reason=f"{self.model} is not registered")
        challenger = m.challenger or ""
        return decide(m, self._arms, now_ms=int(self.clock() * 1000),
                      canary_events=self._seen[challenger] - self._recorded[challenger])

    def tick(self) -> tuple[Action, Verdict | None]:
        """One decision, applied; returns what was done and the verdict it was based on."""
        decision = self.decide()
        try:
            self._apply(decision)
        except ModelRegistryError as exc:  # the state moved under us (an operator acted): decide again next tick
            log.warning("%s: %s not applied, the registry changed meanwhile: %s", self.model, decision.action, exc)
            decision = Decision(action="hold", verdict=decision.verdict, reason=f"{decision.action} refused: {exc}")
        self.last = decision
        return decision.action, decision.verdict

    def _apply(self, d: Decision) -> None:
        r, model, actor = self.registry, self.model, self.actor
        if d.action == "start":
            assert d.share is not None
            r.set_canary(model, d.share, actor, d.reason)
            self._arms, self._seen, self._recorded = {}, Counter(), Counter()  # judge the canary's period only
        elif d.action == "step":
            assert d.share is not None
            r.set_canary(model, d.share, actor, d.reason)
        elif d.action == "rollback":
            assert d.verdict is not None
            challenger = r.state.models[model].challenger
            r.canary_rollback(model, actor, d.reason, d.verdict.model_dump(mode="json"))
            log.warning("%s %s: canary rolled back: %s", model, challenger, d.reason)
        elif d.action == "promote":
            m = r.state.models[model]
            challenger = m.challenger
            assert challenger is not None and m.production is not None
            if d.evidence is not None:
                r.record_shadow(model, challenger, d.evidence.events, CONFIDENCE_P50, d.evidence.challenger,
                                d.evidence.production, actor,
                                f"canary evidence: {d.evidence.events} canary-scored predictions at "
                                f"{m.canary_share:.0%}, confidence p50 {d.evidence.challenger:.4f} vs "
                                f"{d.evidence.production:.4f}")
                self._recorded[challenger] += d.evidence.events
            r.promote(model, challenger, Stage.PRODUCTION, actor, d.reason)
            log.info("%s %s promoted to Production by %s: %s", model, challenger, actor, d.reason)
