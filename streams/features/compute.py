"""The window math and the event-time window state, shared by every engine.

``compute_window`` evaluates a declared feature set over one window's readings: the reference an
app's training script calls (so training and serving compute the same features) and the Faust job
runs; ``compute_windows`` is the same for many windows at once (the embedded engine), and
``band_energies`` the spectral feature for many windows (the Flink job's Python; the rest of its
features are Flink's built-in aggregates, tested equal in ``tests/integration/test_parity.py``).
``PartitionWindows`` is the event-time state of one partition, reading by reading: which windows
are open, the partition's stream time, which windows are closed. The Faust job and the shadow
comparison keep one per partition and feed it records in partition order; the embedded
engine's batch twin (``streams.features.batch.BatchWindows``) makes the same decisions a batch at a
time, so they all emit identical rows. Pure Python and numpy: the Flink job environment imports it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

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
    NaN marks a missing value. Keys are ``fs.aggregate_names``, in order (a table's attributes join later)."""
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


def compute_windows(fs: FeatureSet, values: np.ndarray, bounds: np.ndarray, hz: float | None = None) -> np.ndarray:
    """Features of many windows at once, vectorized across them: the hot path of the embedded engine.

    Window ``i`` holds the readings ``values[bounds[i]:bounds[i + 1]]`` (shape rows × ``len(fs.inputs)``,
    event-time order, NaN for a missing value, at least one reading each). Returns one row per window,
    ``fs.aggregate_names`` in order; each row is ``compute_window`` of its window up to rounding (the sums
    run in another order: within 1e-12 relative).
    """
    values = np.asarray(values, dtype=np.float64).reshape(-1, len(fs.inputs))
    hz = fs.sample_hz if hz is None else hz
    bounds = np.asarray(bounds, dtype=np.int64)
    starts, counts = bounds[:-1], np.diff(bounds)
    windows = len(counts)
    segment = np.repeat(np.arange(windows), counts)
    present = ~np.isnan(values)
    seen = np.add.reduceat(present.astype(np.float64), starts, axis=0) if windows else np.zeros((0, values.shape[1]))
    seen_or_one = np.maximum(seen, 1.0)
    out = np.empty((windows, len(fs.aggregate_names)))
    column = 0
    for agg in fs.aggregations:
        idx = [fs.inputs.index(i) for i in agg.inputs]
        if agg.kind == "missing_rate":
            out[:, column] = 1.0 - seen[:, idx].sum(axis=1) / (counts * len(idx))
            column += 1
        elif agg.kind == "stats":
            sub, seen_sub, any_seen = values[:, idx], seen_or_one[:, idx], seen[:, idx] > 0
            mask = present[:, idx]
            zeroed = np.where(mask, sub, 0.0)
            mean = np.add.reduceat(zeroed, starts, axis=0) / seen_sub
            deviation = np.where(mask, sub - mean[segment], 0.0)
            std = np.sqrt(np.add.reduceat(deviation * deviation, starts, axis=0) / seen_sub)
            low = np.minimum.reduceat(np.where(mask, sub, np.inf), starts, axis=0)
            high = np.maximum.reduceat(np.where(mask, sub, -np.inf), starts, axis=0)
            stat = {"mean": mean, "std": std, "min": low, "max": high, "ptp": high - low}
            for j in range(len(idx)):
                for name in agg.stats:
                    out[:, column] = np.where(any_seen[:, j], stat[name][:, j], 0.0)
                    column += 1
        else:
            out[:, column] = _band_energies(values[:, idx[0]], segment, windows, hz, float(agg.cut_hz))
            column += 1
    return out


def band_energies(times: list[np.ndarray], signals: list[np.ndarray], hz: float, cut_hz: float) -> np.ndarray:
    """``band_energy`` of many windows at once: window i's ``signals[i]`` (NaN for missing) in the order of its
    event times ``times[i]`` (a stable sort: arrival order breaks ties), as ``compute_windows`` orders them."""
    lengths = np.fromiter(map(len, signals), dtype=np.int64, count=len(signals))
    segment = np.repeat(np.arange(len(signals)), lengths)
    t = np.concatenate(times) if len(times) else np.zeros(0, dtype=np.int64)
    x = np.concatenate(signals) if len(signals) else np.zeros(0)
    order = np.lexsort((np.arange(len(t)), t, segment))
    return _band_energies(x[order].astype(np.float64), segment, len(signals), hz, cut_hz)


def _band_energies(signal: np.ndarray, segment: np.ndarray, windows: int, hz: float, cut_hz: float) -> np.ndarray:
    """``band_energy`` of each window's signal, one batched FFT per distinct number of present values."""
    out = np.zeros(windows)
    present = ~np.isnan(signal)
    signal, segment = signal[present], segment[present]
    lengths = np.bincount(segment, minlength=windows)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    for n in np.unique(lengths[lengths >= 4]).tolist():
        which = np.flatnonzero(lengths == n)
        x = signal[offsets[which][:, None] + np.arange(n)]
        power = np.abs(np.fft.rfft(x - x.mean(axis=1, keepdims=True), axis=1)) ** 2
        freqs = np.fft.rfftfreq(n, d=1.0 / hz)
        total = power[:, 1:].sum(axis=1)
        band = power[:, freqs >= cut_hz].sum(axis=1)
        out[which] = np.where(total > 1e-12, band / np.where(total > 1e-12, total, 1.0), 0.0)
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
class PartitionWindows:
    """Event-time windows of the entities of one partition, closed by the partition's stream time.

    The stream time is the newest event time read from the partition, whatever the entity (Kafka
    Streams' stream time; a Flink Kafka source's per-partition watermark before the allowed
    lateness). A window ``[start, start + size)`` of any entity closes when it reaches
    ``end + allowed_lateness``; a reading whose windows are all closed is late: ``add`` says so and
    changes no window. ``closed_through``: every window ending there or before is closed (what a
    restart resumes from; what ``close_all`` moves on when the partition goes quiet).
    """

    fs: FeatureSet
    open: dict[tuple[str, int], OpenWindow] = field(default_factory=dict)
    stream_time: int = -1
    closed_through: int = -1

    def add(self, entity: str, ts: int, row: list[float], position: Any = None,
            handle: Any = None) -> tuple[bool, list[dict]]:
        """Add one reading. Returns (accepted, rows of the windows it closed, each with its ``entity``)."""
        w = self.fs.window
        reach = w.size_ms + w.allowed_lateness_ms
        stream_time = max(self.stream_time, ts)
        starts = self._open_starts(ts, stream_time)
        self.stream_time = stream_time
        if not starts:
            return False, []
        for start in starts:
            window = self.open.get((entity, start))
            if window is None:
                window = self.open[(entity, start)] = OpenWindow(start, position)
            window.ts.append(ts)
            window.rows.append(row)
            window.last = handle
        return True, self._close(lambda start: start + reach <= stream_time)

    def late(self, ts: int) -> bool:
        """Whether a reading at ``ts`` is late (its windows all closed), as :meth:`add` would say; changes nothing."""
        return not self._open_starts(ts, max(self.stream_time, ts))

    def _open_starts(self, ts: int, stream_time: int) -> list[int]:
        """The starts of the windows of a reading at ``ts`` still open at ``stream_time``."""
        w = self.fs.window
        reach = w.size_ms + w.allowed_lateness_ms
        return [s for s in w.starts(ts) if s + reach > stream_time and s + w.size_ms > self.closed_through]

    def advance(self, ts: int) -> list[dict]:
        """Move the stream time to ``ts`` without adding a reading (one the state already holds, read again
        after a restart): the rows of the windows that closes."""
        reach = self.fs.window.size_ms + self.fs.window.allowed_lateness_ms
        self.stream_time = max(self.stream_time, ts)
        return self._close(lambda start: start + reach <= self.stream_time)

    def close_all(self) -> list[dict]:
        """Close every open window (the partition went quiet): its stream time moves past them."""
        w = self.fs.window
        if self.open:
            last_end = max(start for _, start in self.open) + w.size_ms
            self.stream_time = max(self.stream_time, last_end + w.allowed_lateness_ms)
        return self._close(lambda start: True)

    def _close(self, due: Callable[[int], bool]) -> list[dict]:
        rows = []
        for entity, start in sorted(key for key in self.open if due(key[1])):
            window = self.open.pop((entity, start))
            rows.append({"entity": entity, "start": start, "window": window, **finish(self.fs, window)})
            self.closed_through = max(self.closed_through, start + self.fs.window.size_ms)
        return rows


def finish(fs: FeatureSet, window: OpenWindow) -> dict:
    """The output fields of a closed window (without the entity key)."""
    order = np.argsort(np.asarray(window.ts), kind="stable")
    feats = compute_window(fs, np.asarray(window.rows, dtype=np.float64)[order])
    return {"window_start": window.start, "window_end": window.start + fs.window.size_ms,
            "count": len(window.ts), **feats}


def output_row(fs: FeatureSet, entity: str, closed: dict, attributes: Sequence[float] = ()) -> dict:
    """The Avro output record of a closed window, fields in declaration order: its aggregates, then
    ``attributes``, the window's encoded table attributes (``fs.attribute_names``) when the feature set joins one."""
    aggregated = fs.columns[1:len(fs.columns) - len(fs.attribute_names)]
    return {fs.entity.join_key: entity, **{c: closed[c] for c in aggregated},
            **dict(zip(fs.attribute_names, map(float, attributes), strict=True))}
