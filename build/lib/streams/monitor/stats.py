"""Drift statistics: plain functions over arrays, and the sliding-window detector that uses them.

* ``ks``: two-sample Kolmogorov–Smirnov test of a live sample against the reference sample
  (``scipy.stats.ks_2samp``): the seeds' drift test, sensitive to any change of shape;
* ``psi``: population stability index over the reference's decile bins: how much mass moved,
  robust to the huge samples that make KS reject trivial differences;
* ``categorical``: chi-square test and PSI of category counts (predicted labels), with an
  ``<other>`` bin for categories the reference never had.

A feature is *flagged* in an evaluation when both agree: KS p-value below ``ks_pvalue`` **and**
PSI at or above ``psi``. A flag that lasts ``consecutive`` evaluations is a *sustained* drift:
``DriftDetector`` reports it once per episode (an alert), and again only after the feature was
clean for an evaluation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import stats

#: Share given to an empty bin so that PSI stays finite (the usual convention).
PSI_EPSILON = 1e-4
OTHER = "<other>"


class Thresholds(BaseModel):
    """When a feature is flagged and when a flag becomes an alert. Live values come from the config
    center (``monitor-threshold``: ``drift.ks_pvalue``, ``drift.psi``, ``drift.consecutive``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ks_pvalue: float = Field(1e-3, gt=0, lt=1, description="Flag when the KS (or chi-square) p-value is below this.")
    psi: float = Field(0.2, ge=0, description="…and the PSI is at or above this (0.1 watch, 0.2 act, by convention).")
    consecutive: int = Field(3, ge=1, description="Evaluations in a row a feature must stay flagged to raise an alert.")


@dataclass(frozen=True, slots=True)
class TestResult:
    """One feature in one evaluation."""

    test: str  # "ks" or "chi2"
    statistic: float
    pvalue: float
    psi: float


def bin_edges(reference: np.ndarray, bins: int = 10) -> np.ndarray:
    """Inner edges of the reference's quantile bins; point masses (many equal values) merge bins."""
    qs = np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1])
    return np.unique(qs)


def shares(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Share of ``values`` in each bin ``(-inf, e0], (e0, e1], …, (e_last, inf)``."""
    idx = np.searchsorted(edges, values, side="left")
    counts = np.bincount(idx, minlength=len(edges) + 1).astype(np.float64)
    return counts / max(1, len(values))


def psi_of_shares(expected: np.ndarray, actual: np.ndarray, eps: float = PSI_EPSILON) -> float:
    """Σ (a − e) · ln(a / e) with empty bins floored at ``eps``."""
    e = np.clip(expected, eps, None)
    a = np.clip(actual, eps, None)
    return float(np.sum((a - e) * np.log(a / e)))


def psi(reference: np.ndarray, current: np.ndarray, bins: int = 10) -> float:
    """PSI of ``current`` against ``reference`` over the reference's quantile bins."""
    edges = bin_edges(reference, bins)
    return psi_of_shares(shares(reference, edges), shares(current, edges))


def ks(reference: np.ndarray, current: np.ndarray) -> tuple[float, float]:
    """Two-sample KS test: (statistic, p-value)."""
    result = stats.ks_2samp(reference, current)
    return float(result.statistic), float(result.pvalue)


def categorical(reference: Mapping[str, float], current: Sequence[str]) -> TestResult:
    """Chi-square test and PSI of ``current`` labels against the reference label shares."""
    cats = [*sorted(reference), OTHER]
    expected = np.array([reference.get(c, 0.0) for c in cats], dtype=np.float64)
    expected = expected / expected.sum()
    counts = np.zeros(len(cats))
    for label in current:
        counts[cats.index(label) if label in reference else len(cats) - 1] += 1
    n = counts.sum()
    if n == 0:
        return TestResult("chi2", 0.0, 1.0, 0.0)
    floor = np.clip(expected, PSI_EPSILON, None)
    floor = floor / floor.sum()
    statistic, pvalue = stats.chisquare(counts, floor * n)
    return TestResult("chi2", float(statistic), float(pvalue), psi_of_shares(expected, counts / n))


@dataclass(frozen=True)
class NumericReference:
    """The reference sample of one numeric feature, prepared once (bins and their shares)."""

    sample: np.ndarray
    edges: np.ndarray
    expected: np.ndarray

    @classmethod
    def of(cls, sample: np.ndarray, bins: int = 10) -> NumericReference:
        sample = np.asarray(sample, dtype=np.float64)
        sample = sample[np.isfinite(sample)]
        edges = bin_edges(sample, bins)
        return cls(sample, edges, shares(sample, edges))

    def test(self, current: np.ndarray) -> TestResult:
        current = np.asarray(current, dtype=np.float64)
        current = current[np.isfinite(current)]
        if current.size == 0:
            return TestResult("ks", 0.0, 1.0, 0.0)
        statistic, pvalue = ks(self.sample, current)
        return TestResult("ks", statistic, pvalue, psi_of_shares(self.expected, shares(current, self.edges)))


@dataclass(frozen=True, slots=True)
class FeatureVerdict:
    """A feature's result in one evaluation, with the detector's memory of it."""

    feature: str
    result: TestResult
    flagged: bool
    consecutive: int  # evaluations in a row it has been flagged, this one included
    alert: bool  # this evaluation made the drift sustained (once per episode)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation of the sliding window: every feature's verdict and the window's event-time span."""

    index: int
    rows: int
    start_ms: int
    end_ms: int
    verdicts: tuple[FeatureVerdict, ...]

    @property
    def flagged(self) -> bool:
        return any(v.flagged for v in self.verdicts)

    @property
    def alerts(self) -> tuple[FeatureVerdict, ...]:
        return tuple(v for v in self.verdicts if v.alert)


@dataclass
class DriftDetector:
    """Sliding windows of the last ``window`` rows, evaluated every ``step`` rows against references.

    ``numeric`` maps a feature to its reference; ``categories`` maps a categorical feature to its
    reference shares. Rows are dicts carrying those features plus their event time (``ts_ms``).
    """

    numeric: Mapping[str, NumericReference]
    categories: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    window: int = 300
    step: int = 100
    _rows: deque = field(init=False)
    _since: int = field(init=False, default=0)
    _evaluations: int = field(init=False, default=0)
    _streak: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.step <= self.window:
            raise ValueError(f"step must be in [1, window]; got step={self.step}, window={self.window}")
        self._rows = deque(maxlen=self.window)

    @property
    def features(self) -> list[str]:
        return [*self.numeric, *self.categories]

    def add(self, rows: Sequence[Mapping[str, object]], thresholds: Thresholds) -> list[Evaluation]:
        """Append rows in arrival order; returns the evaluations that became due."""
        out = []
        for row in rows:
            self._rows.append(row)
            self._since += 1
            if len(self._rows) == self.window and self._since >= self.step:
                self._since = 0
                out.append(self.evaluate(thresholds))
        return out

    def evaluate(self, thresholds: Thresholds) -> Evaluation:
        """Test the current window now."""
        rows = list(self._rows)
        ts = [int(r.get("ts_ms", 0)) for r in rows]  # type: ignore[call-overload]
        verdicts = []
        for name, ref in self.numeric.items():
            verdicts.append(self._verdict(name, ref.test(np.array([r[name] for r in rows], dtype=np.float64)),
                                          thresholds))
        for name, ref_shares in self.categories.items():
            verdicts.append(self._verdict(name, categorical(ref_shares, [str(r[name]) for r in rows]), thresholds))
        self._evaluations += 1
        return Evaluation(self._evaluations, len(rows), min(ts, default=0), max(ts, default=0), tuple(verdicts))

    def _verdict(self, name: str, result: TestResult, thresholds: Thresholds) -> FeatureVerdict:
        flagged = result.pvalue < thresholds.ks_pvalue and result.psi >= thresholds.psi
        streak = self._streak.get(name, 0) + 1 if flagged else 0
        self._streak[name] = streak
        return FeatureVerdict(name, result, flagged, streak, alert=flagged and streak == thresholds.consecutive)
