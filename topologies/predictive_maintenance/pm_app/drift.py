"""Offline measurements of the drift detector on simulated feature windows (no Kafka).

A *stationary stream* is the training process itself with another seed: a fresh fleet drawn
like the training fleet, its feature windows in random order, so every stretch of the stream
has the training distribution (the null hypothesis holds by construction). A *shifted stream*
is a stationary stream up to ``onset`` rows, then windows of the same kind of fleet carrying a
``Drift`` from the simulator. Rows carry ``ts_ms`` spaced as a fleet of ``fleet_devices``
devices emitting one window each per ``window_s`` would space them, to turn rows into seconds.

* false-alarm rate: evaluations of a stationary stream with any feature flagged, and sustained
  alerts per evaluation;
* detection delay: rows (and seconds at that fleet's rate) from the onset to the first alert
  naming the drifted feature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pm_app import FEATURE_NAMES, FEATURE_SET, feature_vector, window_features
from pm_app.simulator import Drift, windows_for_training
from pm_app.train import DatasetParams
from streams.monitor.stats import DriftDetector, NumericReference, Thresholds


def feature_rows(params: DatasetParams, seed: int, drifts: Sequence[Drift] = ()) -> list[dict]:
    """Feature windows of a training-like fleet (seed ``seed``), each joined with its device's register entry,
    shuffled, without timestamps."""
    windows, _, _, registers = windows_for_training(params.n_devices, params.seconds, params.window_s, params.hz,
                                                    seed, drifts=drifts)
    x = np.array([feature_vector(window_features(w, params.hz), r) for w, r in zip(windows, registers)],
                 dtype=np.float64)
    np.random.default_rng(seed).shuffle(x)
    return [dict(zip(FEATURE_NAMES, row)) for row in x]


def stamp(rows: list[dict], fleet_devices: int, window_s: float, start_ms: int = 0) -> list[dict]:
    """Give rows event times as a fleet of ``fleet_devices`` devices would produce them."""
    gap_ms = window_s * 1000 / fleet_devices
    return [{**r, "ts_ms": start_ms + int(i * gap_ms)} for i, r in enumerate(rows)]


#: The features the topology's drift job tests (``compare: aggregates``): the window aggregates, not the register's
#: rated values, which are constant per device.
COMPARED: tuple[str, ...] = FEATURE_SET.aggregate_names


def references(reference: Mapping[str, np.ndarray], bins: int = 10) -> dict[str, NumericReference]:
    """The references of the ``COMPARED`` features from a baseline's samples (name → column)."""
    return {name: NumericReference.of(reference[name], bins) for name in COMPARED}


@dataclass(frozen=True)
class FalseAlarms:
    evaluations: int
    flagged: int  # evaluations with at least one feature flagged
    alerts: int  # sustained-drift alerts raised

    @property
    def flagged_rate(self) -> float:
        return self.flagged / max(1, self.evaluations)

    @property
    def alert_rate(self) -> float:
        return self.alerts / max(1, self.evaluations)


@dataclass(frozen=True)
class Detection:
    drift: Drift
    onset_row: int
    alert_row: int | None  # the row whose arrival completed the alerting evaluation
    feature: str | None  # the first feature alerted on

    @property
    def delay_rows(self) -> int | None:
        return None if self.alert_row is None else self.alert_row - self.onset_row

    def delay_s(self, fleet_devices: int, window_s: float) -> float | None:
        rows = self.delay_rows
        return None if rows is None else rows * window_s / fleet_devices


def false_alarms(refs: Mapping[str, NumericReference], rows: Sequence[Mapping], thresholds: Thresholds,
                 window: int, step: int) -> FalseAlarms:
    detector = DriftDetector(refs, window=window, step=step)
    evaluations = detector.add(rows, thresholds)
    return FalseAlarms(len(evaluations), sum(e.flagged for e in evaluations), sum(len(e.alerts) for e in evaluations))


def detect(refs: Mapping[str, NumericReference], before: Sequence[Mapping], after: Sequence[Mapping], drift: Drift,
           thresholds: Thresholds, window: int, step: int) -> Detection:
    """Feed ``before`` then ``after``; the first alert at or after the onset, on any feature."""
    detector = DriftDetector(refs, window=window, step=step)
    detector.add(before, thresholds)
    for i, row in enumerate(after, start=1):
        for evaluation in detector.add([row], thresholds):
            if evaluation.alerts:
                return Detection(drift, len(before), len(before) + i, evaluation.alerts[0].feature)
    return Detection(drift, len(before), None, None)


#: What the drift job promises on the reference topology's settings (window 300, step 100,
#: consecutive 3), checked by tests/unit/test_drift.py and measured by benchmarks/bench_drift.py:
#: at most this many sustained-drift alerts per evaluation of a stationary stream…
DECLARED_ALERT_RATE = 0.01


def declared_delay_rows(step: int, consecutive: int) -> int:
    """…and a shift of a sensor by one spread of its fleet alerted within this many rows of the onset:
    ``consecutive`` flagged evaluations, plus one step for the drifted rows to weigh in the window."""
    return step * (consecutive + 1)
