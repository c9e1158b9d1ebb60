"""Canary health and schedule: grow the canary's share step by step, roll it back when it is worse.

The seeds' rule: route 1 % to the new version, raise the share by 5 % per interval, and roll
back automatically when the canary's output confidence p50 is more than 5 % below the
baseline's. :func:`judge` is that rule as a pure function of the two arms' confidences;
:class:`CanaryController` feeds on scored predictions (version, confidence) and applies the
verdict to the registry — a share step, or a recorded ``canary-rollback`` event.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from streams.lifecycle.state import CanarySchedule

if TYPE_CHECKING:
    from streams.lifecycle.registry import ModelRegistry

log = logging.getLogger("tangram.lifecycle.canary")


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


Action = Literal["start", "step", "hold", "rollback", "idle"]


class CanaryController:
    """Drives one model's canary from scored predictions.

    ``observe(version, confidence)`` for every prediction (production and challenger);
    ``tick()`` now and then: starts the canary at the schedule's initial share, steps it up
    once per interval while it is healthy, and rolls it back (recorded, with the verdict) when
    it is not. Windows keep the last ``window`` confidences per arm.
    """

    def __init__(self, registry: ModelRegistry, model: str, *, actor: str = "canary-controller",
                 window: int = 5000, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.model = model
        self.actor = actor
        self.clock = clock
        self._arms: dict[str, deque[float]] = {}
        self._window = window
        self._last_step: float | None = None

    def observe(self, version: str, confidence: float) -> None:
        self._arms.setdefault(version, deque(maxlen=self._window)).append(float(confidence))

    def observe_many(self, version: str, confidences: Iterable[float]) -> None:
        for c in confidences:
            self.observe(version, c)

    def tick(self) -> tuple[Action, Verdict | None]:
        """One decision; returns what was done and the verdict it was based on."""
        state = self.registry.refresh()
        m = state.models.get(self.model)
        if m is None or m.challenger is None or m.production is None:
            return "idle", None
        schedule = m.policy.canary
        if m.canary_share == 0:
            self.registry.set_canary(self.model, schedule.initial_share, self.actor,
                                     f"canary start at {schedule.initial_share:.0%}")
            self._last_step, self._arms = self.clock(), {}
            return "start", None
        verdict = judge(self._arms.get(m.production, ()), self._arms.get(m.challenger, ()), schedule)
        if verdict.healthy is False:
            self.registry.canary_rollback(self.model, self.actor, f"automatic: {verdict.detail}",
                                          verdict.model_dump(mode="json"))
            log.warning("%s %s: canary rolled back: %s", self.model, m.challenger, verdict.detail)
            return "rollback", verdict
        due = self._last_step is None or self.clock() - self._last_step >= schedule.interval_s
        if verdict.healthy and due and m.canary_share < schedule.max_share:
            share = round(min(schedule.max_share, m.canary_share + schedule.step), 6)
            self.registry.set_canary(self.model, share, self.actor, f"healthy: {verdict.detail}")
            self._last_step = self.clock()
            return "step", verdict
        return "hold", verdict
