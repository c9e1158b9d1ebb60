"""The window math and the per-entity window state, shared by every engine.

``compute_window`` evaluates a declared feature set over one window's readings: the one
function every engine calls, and an app's training script too (so training and serving
compute the same features). ``EntityWindows`` is the event-time state of
one entity: which windows are open, its watermark (newest event time seen), which
windows it has emitted. The embedded engine, the Faust job and the PyFlink job each
keep one per entity and feed it records in partition order, so they emit identical
rows. Pure Python and numpy: the Flink job environment imports it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streams.features.spec import FeatureSet


def band_energy(signal: np.ndarray, hz: float, cut_hz: float) -> float:
    """Share of the signal's spectral energy (DC removed) at or above ``cut_hz``."""
    x = signal[~np.isnan(signal)]
    if x.size < 4:
        return 0.0
    power = np.abs(np.fft.rfft(x - x.mean())) ** 2
    freqs = np.fft.rfftfreq(x.size, d=1.0 / hz)
    total = power[1:].sum()
    return float(power[freqs >= cut_hz].sum() / total) if total > 1e-12 else 0.0


def _stat(col: np.ndarray, stat: str) -> float:
    if not col.size:
        return 0.0
    if stat == "mean":
        return float(col.mean())
    if stat == "std":
        return float(col.std())
    if stat == "min":
        return float(col.min())
    if stat == "max":
        return float(col.max())
    return float(col.max()) - float(col.min())  # ptp


def compute_window(fs: FeatureSet, values: np.ndarray, hz: float | None = None) -> dict[str, float]:
    """Features of one window. ``values`` has shape (samples, len(fs.inputs)), in event-time order;
    NaN marks a missing value. Keys are ``fs.feature_names``, in order."""
    values = np.asarray(values, dtype=np.float64).reshape(-1, len(fs.inputs))
    hz = fs.sample_hz if hz is None else hz
    present = ~np.isnan(values)
    out: dict[str, float] = {}
    for agg in fs.aggregations:
        idx = [fs.inputs.index(i) for i in agg.inputs]
        if agg.kind == "missing_rate":
            sub = present[:, idx]
            out["missing_rate"] = float(1.0 - sub.mean()) if sub.size else 1.0
        elif agg.kind == "stats":
            for j, name in zip(idx, agg.inputs):
                col = values[present[:, j], j]
                out.update({f"{name}_{s}": _stat(col, s) for s in agg.stats})
        else:
            out[f"{agg.inputs[0]}_band_energy"] = band_energy(values[:, idx[0]], hz, float(agg.cut_hz))
    return out


@dataclass
class OpenWindow:
    """Readings of one window not yet emitted, and where the first of them was read."""

    start: int
    first: Any  # engine-specific position of the first reading (e.g. (topic, partition, offset))
    ts: list[int] = field(default_factory=list)
    rows: list[list[float]] = field(default_factory=list)
    last: Any = None  # engine-specific handle of the newest reading (e.g. its Record, for headers)


@dataclass
class EntityWindows:
    """Event-time windows of one entity, closed when its watermark passes end + allowed lateness.

    The watermark is the newest event time seen for the entity. A reading whose windows
    are all closed or already emitted is late: ``add`` says so and changes nothing.
    """

    fs: FeatureSet
    open: dict[int, OpenWindow] = field(default_factory=dict)
    watermark: int = -1
    emitted_end: int = -1  # end of the newest window emitted

    def add(self, ts: int, row: list[float], position: Any = None, handle: Any = None) -> tuple[bool, list[dict]]:
        """Add one reading. Returns (accepted, rows of the windows this reading closed)."""
        w = self.fs.window
        starts = [s for s in w.starts(ts) if s + w.size_ms > self.emitted_end and not self._closed(s)]
        if not starts:
            return False, []
        for start in starts:
            window = self.open.get(start)
            if window is None:
                window = self.open[start] = OpenWindow(start, position)
            window.ts.append(ts)
            window.rows.append(row)
            window.last = handle
        if ts > self.watermark:
            self.watermark = ts
            return True, self._close_ready()
        return True, []

    def _closed(self, start: int) -> bool:
        w = self.fs.window
        return start not in self.open and start + w.size_ms + w.allowed_lateness_ms <= self.watermark

    def _close_ready(self) -> list[dict]:
        w = self.fs.window
        ready = sorted(s for s in self.open if s + w.size_ms + w.allowed_lateness_ms <= self.watermark)
        rows = []
        for start in ready:
            window = self.open.pop(start)
            rows.append({"start": start, "window": window, **finish(self.fs, window)})
            self.emitted_end = max(self.emitted_end, start + w.size_ms)
        return rows


def finish(fs: FeatureSet, window: OpenWindow) -> dict:
    """The output fields of a closed window (without the entity key)."""
    order = np.argsort(np.asarray(window.ts), kind="stable")
    feats = compute_window(fs, np.asarray(window.rows, dtype=np.float64)[order])
    return {"window_start": window.start, "window_end": window.start + fs.window.size_ms,
            "count": len(window.ts), **feats}


def output_row(fs: FeatureSet, entity: str, closed: dict) -> dict:
    """The Avro output record of a closed window, fields in declaration order."""
    return {fs.entity.join_key: entity, **{c: closed[c] for c in fs.columns[1:]}}
