"""Degradation levels L0–L3: golden signals measured from the data, triggers with hysteresis, a manual switch.

The rule processor reads both the feature windows and the predictions, so it sees the model
stop before anyone tells it:

* ``missing_predictions``: of the feature windows that arrived within ``window_s`` and are at least
  ``prediction_wait_ms`` old, the share that got no prediction (inference errors, a stopped
  Triton, a paused worker all show up here);
* ``inference_p99_ms``: the 99th percentile of the predictions' ``inference_ms`` within ``window_s``;
* ``prediction_age_s``: wall seconds since the newest prediction, while feature windows keep arriving.

A :class:`Trigger` raises the level while its signal is above ``above`` and releases it only once
the signal has stayed below ``below`` for ``hold_s`` (hysteresis: no flapping). The level in effect
is the highest of the manual switch (config center ``feature-switch/degradation.level``) and of the
active triggers: an operator can force a level, the signals can only add to it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client import Counter, Gauge

from streams.rules.spec import LEVELS, DegradationSpec, Level, Trigger

log = logging.getLogger("tangram.rules.degradation")

LEVEL = Gauge("tangram_rules_degradation_level", "Degradation level in effect (0-3).", ["processor"])
LEVEL_CHANGES = Counter("tangram_rules_degradation_changes_total", "Level changes, by level entered and cause.",
                        ["processor", "level", "cause"])
SIGNAL = Gauge("tangram_rules_signal", "Golden signals the degradation triggers watch (NaN: not enough data).",
               ["processor", "signal"])

Clock = Callable[[], float]


def rank(level: Level) -> int:
    return LEVELS.index(level)


class GoldenSignals:
    """The signals, measured from the feature windows and predictions the processor reads.

    Each is kept incrementally, so measuring them costs the same at 100 records a second and at
    100,000: windows waiting for their prediction (and predictions for their window) expire from the
    oldest, outcomes keep a running count, and the inference p99 is taken over the newest
    ``LATENCY_SAMPLES`` predictions of the window.
    """

    #: The most recent predictions the inference p99 is computed over (a batch's p99, not a window's, beyond it).
    LATENCY_SAMPLES = 4096

    def __init__(self, spec: DegradationSpec, clock: Clock = time.monotonic):
        self.spec = spec
        self.clock = clock
        # both in arrival order (the clock only moves forward), so the oldest expire first
        self._pending: dict[tuple[str, int], float] = {}  # feature window → when it arrived
        self._predicted: dict[tuple[str, int], float] = {}  # predictions whose window has not arrived (yet)
        self._outcomes: deque[tuple[float, bool]] = deque()  # (when decided, missing?)
        self._missing = 0  # of the outcomes, those missing
        # the newest predictions' inference latencies as runs [arrived, latency ms, predictions]: the rows of one
        # Triton batch share its round trip, so a window of thousands of predictions is a few dozen runs, and
        # its p99 is read off them sorted (an array of every sample, each batch, cost more than the rules)
        self._runs: deque[list] = deque()
        self._samples = 0
        self._last_window: float | None = None
        self._last_prediction: float | None = None
        self._started = clock()

    def _outcome(self, now: float, missing: bool) -> None:
        self._outcomes.append((now, missing))
        self._missing += missing

    def window(self, device: str, window_end: int) -> None:
        now = self.clock()
        self._last_window = now
        key = (device, window_end)
        if self._predicted.pop(key, None) is not None:
            self._outcome(now, False)
        else:
            self._pending.setdefault(key, now)

    def prediction(self, device: str, window_end: int, inference_ms: float) -> None:
        self.predictions([device], [window_end], [inference_ms])

    def predictions(self, devices: Sequence[str], window_ends: Sequence[int], inference_ms: Sequence[float]) -> None:
        """:meth:`prediction` for each of a batch's predictions (one clock reading: they arrived together)."""
        if not len(devices):
            return
        now = self.clock()
        self._last_prediction = now
        runs = self._runs
        for latency, same in itertools.groupby(map(float, inference_ms)):
            count = sum(1 for _ in same)
            runs.append([now, latency, count])
            self._samples += count
        while self._samples > self.LATENCY_SAMPLES:  # the oldest beyond the newest LATENCY_SAMPLES
            drop = min(runs[0][2], self._samples - self.LATENCY_SAMPLES)
            runs[0][2] -= drop
            self._samples -= drop
            if not runs[0][2]:
                runs.popleft()
        pending, predicted, wait = self._pending, self._predicted, self.spec.prediction_wait_ms / 1000
        for key in zip(devices, window_ends):
            arrived = pending.pop(key, None)
            if arrived is not None:
                self._outcome(now, now - arrived > wait)
            else:
                predicted.pop(key, None)  # re-inserted: its place is its newest arrival
                predicted[key] = now

    def _p99(self) -> float:
        """The 99th percentile of the latencies in the runs, as ``numpy.percentile`` computes it over every sample
        (linear between the two samples around rank 0.99 * (n - 1))."""
        ordered = sorted((latency, count) for _, latency, count in self._runs)
        ends = np.cumsum([count for _, count in ordered])  # the rank after each run's last sample
        rank = 0.99 * (self._samples - 1)
        low = int(rank)
        at = np.searchsorted(ends, [low, min(low + 1, self._samples - 1)], side="right")
        below, above = ordered[at[0]][0], ordered[at[1]][0]
        return below + (above - below) * (rank - low)

    def values(self) -> dict[str, float | None]:
        """Every signal now (None: not enough data in the window for a verdict)."""
        now = self.clock()
        wait, horizon = self.spec.prediction_wait_ms / 1000, now - self.spec.window_s
        while self._pending and now - next(iter(self._pending.values())) >= wait:
            del self._pending[next(iter(self._pending))]
            self._outcome(now, True)
        while self._predicted and next(iter(self._predicted.values())) < horizon - 60:
            del self._predicted[next(iter(self._predicted))]
        while self._outcomes and self._outcomes[0][0] < horizon:
            self._missing -= self._outcomes.popleft()[1]
        while self._runs and self._runs[0][0] < horizon:
            self._samples -= self._runs.popleft()[2]
        n = len(self._outcomes)
        missing = self._missing / n if n >= self.spec.min_samples else None
        p99 = self._p99() if self._samples >= self.spec.min_samples else None
        windows_flowing = self._last_window is not None and self._last_window >= horizon
        age = now - (self._last_prediction or self._started) if windows_flowing else None
        return {"missing_predictions": missing, "inference_p99_ms": p99, "prediction_age_s": age}


class LevelController:
    """The level in effect: max(manual switch, active triggers), with hysteresis on the way back."""

    def __init__(self, spec: DegradationSpec, processor: str, manual: Level = "L0", clock: Clock = time.monotonic):
        self.spec = spec
        self.processor = processor
        self.clock = clock
        self.manual: Level = manual
        self.active: dict[int, bool] = {i: False for i in range(len(spec.triggers))}
        self._good_since: dict[int, float | None] = {i: None for i in range(len(spec.triggers))}
        self.level: Level = manual
        self.cause = "manual"
        LEVEL.labels(processor).set(rank(manual))

    def set_manual(self, level: Level) -> Level:
        self.manual = level
        return self._settle("manual switch")

    def update(self, values: dict[str, float | None]) -> Level:
        """Feed the current signals; returns the level in effect."""
        now = self.clock()
        for name, value in values.items():
            SIGNAL.labels(self.processor, name).set(float("nan") if value is None else value)
        changed: list[str] = []
        for i, trigger in enumerate(self.spec.triggers):
            value = values.get(trigger.signal)
            if value is None:
                continue  # no data, no verdict: keep the state
            if not self.active[i]:
                if value > trigger.above:
                    self.active[i], self._good_since[i] = True, None
                    changed.append(f"{trigger.signal}={value:.3g} > {trigger.above:g}")
            elif value < trigger.below:
                since = self._good_since[i] = self._good_since[i] if self._good_since[i] is not None else now
                if now - since >= trigger.hold_s:
                    self.active[i], self._good_since[i] = False, None
                    changed.append(f"{trigger.signal}={value:.3g} < {trigger.below:g} for {trigger.hold_s:g}s")
            else:
                self._good_since[i] = None
        return self._settle("; ".join(changed) or self.cause)

    def triggered(self) -> list[Trigger]:
        return [t for i, t in enumerate(self.spec.triggers) if self.active[i]]

    def _settle(self, cause: str) -> Level:
        auto = max((rank(t.level) for t in self.triggered()), default=0)
        level = LEVELS[max(rank(self.manual), auto)]
        if level != self.level:
            log.warning("%s: degradation level %s → %s (%s)", self.processor, self.level, level, cause)
            LEVEL_CHANGES.labels(self.processor, level, "manual" if cause == "manual switch" else "signal").inc()
            LEVEL.labels(self.processor).set(rank(level))
            self.level, self.cause = level, cause
        return self.level
