"""The embedded engine's window state, updated a micro-batch at a time with numpy.

:class:`BatchWindows` holds the event-time windows of every entity one processor reads and takes
a whole decoded batch per call: which readings are late, which windows they join, which windows
close, all computed with array operations over the batch; Python runs once per (entity, window)
group of the batch and once per window closed, never once per reading. Its decisions are those of
:class:`streams.features.compute.EntityWindows`, the per-reading state machine the other engines run
(``tests/unit/test_features.py`` feeds both the same readings): per entity, a window
``[start, start + size)`` closes when the entity's watermark (its newest event time) reaches
``end + allowed_lateness``; a reading whose windows are all closed, or were emitted before a
restart (``emitted_end``), is late.

A closed window's features come from :func:`streams.features.compute.compute_windows`, for every
window a batch closed in one call.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from streams.features.compute import compute_windows
from streams.features.spec import FeatureSet


class _Chunk(NamedTuple):
    """The accepted readings of one batch, grouped by (entity, window): a window holds spans of chunks."""

    ts: np.ndarray
    values: np.ndarray
    source: np.ndarray  # index of each reading in the batch as it arrived
    handles: list


@dataclass
class _Window:
    """The readings of one open window: spans ``(chunk, begin, end)`` of the batches that brought them."""

    start: int
    first: tuple[int, int]  # (partition, offset) of its first reading: the commit may not pass it
    spans: list[tuple[_Chunk, int, int]] = field(default_factory=list)

    @property
    def last(self) -> Any:
        """The handle of its newest reading (the engine's Record: headers of the output)."""
        chunk, _, end = self.spans[-1]
        return chunk.handles[int(chunk.source[end - 1])]


class Closed(NamedTuple):
    """A window that closed: its entity, start, last reading's handle, and the reading that closed it."""

    entity: str
    start: int
    window: _Window
    closer: Any


class Batch(NamedTuple):
    """What one batch did, per reading in input order: late (a dead letter), or a re-read of one already
    counted before a restart (left out, counted); which windows closed; which entities it touched."""

    late: np.ndarray
    reread: np.ndarray
    closed: list[Closed]
    entities: np.ndarray


_UNSET = 2**62  # no open window (far enough from the int64 limit to add a window length to)


class BatchWindows:
    """Per-entity event-time windows of every entity of one processor, fed a batch at a time."""

    def __init__(self, fs: FeatureSet, position: Callable[[Any], tuple[int, int]]):
        """``position(handle)``: the (partition, offset) of a reading, from the handle the engine passes with it."""
        self.fs = fs
        self.position = position
        w = fs.window
        self.size, self.hop, self.lateness = w.size_ms, w.hop_ms, w.allowed_lateness_ms
        self.per_reading = w.size_ms // w.hop_ms  # windows each reading belongs to
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self.watermark = np.empty(0, dtype=np.int64)
        self.emitted_end = np.empty(0, dtype=np.int64)
        self.partition = np.empty(0, dtype=np.int64)
        self._oldest = np.empty(0, dtype=np.int64)  # start of each entity's oldest open window
        self._recorded = np.empty(0, dtype=np.int64)  # closed_through as last handed out by changed_state
        self.open: dict[tuple[int, int], _Window] = {}  # (entity, start) → window
        self._starts: dict[int, list[int]] = {}  # entity → starts of its open windows
        self._firsts: dict[int, list[tuple[int, int, int]]] = {}  # partition → heap of (offset, entity, start)

    # -- entities --------------------------------------------------------------------------
    def unknown(self, entities: list[str]) -> list[str]:
        """The entities of ``entities`` not seen since start (or since their partition was revoked), once each."""
        index = self._index
        return list(dict.fromkeys(e for e in entities if e not in index))

    def register(self, entities: list[str], closed_through: list[int], partitions: list[int]) -> None:
        """Start tracking ``entities`` and their partition; ``closed_through`` is what :meth:`closed_through`
        said of each before a restart (-1: nothing known): every window ending there or before is closed."""
        first = len(self._names)
        for i, entity in enumerate(entities):
            self._index[entity] = first + i
        self._names.extend(entities)
        closed = np.asarray(closed_through, dtype=np.int64)
        self.watermark = np.concatenate((self.watermark, np.where(closed >= 0, closed + self.lateness, -1)))
        self.emitted_end = np.concatenate((self.emitted_end, closed))
        self._recorded = np.concatenate((self._recorded, closed))
        self.partition = np.concatenate((self.partition, np.asarray(partitions, dtype=np.int64)))
        self._oldest = np.concatenate((self._oldest, np.full(len(entities), _UNSET, dtype=np.int64)))

    def name(self, entity: int) -> str:
        return self._names[entity]

    def closed_through(self, entities: np.ndarray) -> np.ndarray:
        """The end of the newest window closed for each entity: every window ending there or before is closed.

        Window ends are multiples of the hop, so this one number says what the watermark says of every
        window (closed iff ``end + allowed_lateness <= watermark``), and it changes once per hop of event
        time, not with every reading: it is what a restart needs (``streams.features.progress``).
        """
        wm = self.watermark[entities]
        reached = np.where(wm >= 0, (wm - self.lateness) // self.hop * self.hop, -1)
        return np.maximum(self.emitted_end[entities], reached)

    def changed_state(self, entities: np.ndarray) -> list[tuple[str, int]]:
        """(entity, closed_through) of ``entities`` whose closed_through moved since it was last handed out."""
        now = self.closed_through(entities)
        moved = now != self._recorded[entities]
        self._recorded[entities[moved]] = now[moved]
        return [(self._names[e], x) for e, x in zip(entities[moved].tolist(), now[moved].tolist())]

    def ids(self, entities: list[str]) -> np.ndarray:
        index = self._index
        return np.fromiter((index[e] for e in entities), dtype=np.int64, count=len(entities))

    # -- one batch -------------------------------------------------------------------------
    def add(self, entities: np.ndarray, ts: np.ndarray, values: np.ndarray, handles: list,
            reread: np.ndarray | None = None) -> Batch:
        """Add a batch of readings (arrival order): ``entities`` from :meth:`ids`, event times, input values
        (rows × inputs, NaN = missing), and each reading's handle (its position, its headers).

        ``reread`` marks the readings processed before a restart (below the offset its progress recorded):
        those of windows still open rebuild them; the others were counted in a window emitted before, or
        dead-lettered then, and are left out as re-reads rather than called late.
        """
        n = len(ts)
        if n == 0:
            return Batch(np.zeros(0, dtype=bool), np.zeros(0, dtype=bool), [], np.zeros(0, dtype=np.int64))
        order = np.argsort(entities, kind="stable")  # by entity, arrival order within each
        ent, t = entities[order], ts[order]
        head = np.flatnonzero(np.concatenate(([True], ent[1:] != ent[:-1])))
        segment = np.repeat(np.arange(len(head)), np.diff(np.append(head, n)))
        uniq = ent[head]
        # the entity's watermark once each reading is counted: its newest event time so far
        wm = _segmented_cummax(np.maximum(t, self.watermark[uniq][segment]), segment, head)
        last = t - t % self.hop
        k = self.per_reading
        candidates = last[:, None] - np.arange(k)[None, :] * self.hop  # every window start of each reading
        ends = candidates + self.size
        takes = (ends + self.lateness > wm[:, None]) & (ends > self.emitted_end[ent][:, None])
        refused = np.empty(n, dtype=bool)
        refused[order] = ~takes.any(axis=1)
        again = refused & reread if reread is not None else np.zeros(n, dtype=bool)
        self._join(ent, candidates, takes, order, t, values, handles)
        tail = np.append(head[1:], n) - 1
        self.watermark[uniq] = wm[tail]
        return Batch(refused & ~again, again, self._close(uniq, head, tail, wm, order, handles), uniq)

    def _join(self, ent: np.ndarray, candidates: np.ndarray, takes: np.ndarray, order: np.ndarray, t: np.ndarray,
              values: np.ndarray, handles: list) -> None:
        """Append each accepted reading to its windows: one span per (entity, window) of the batch."""
        row, j = np.nonzero(takes)  # row-major: (entity, arrival) order, then window
        if not len(row):
            return
        e, s = ent[row], candidates[row, j]
        group = np.lexsort((row, s, e))  # by entity, window start, then arrival
        row, e, s = row[group], e[group], s[group]
        cut = np.flatnonzero(np.concatenate(([True], (e[1:] != e[:-1]) | (s[1:] != s[:-1]))))
        source = order[row]
        chunk = _Chunk(t[row], values[source], source, handles)
        bounds = np.append(cut, len(row)).tolist()
        windows = self.open
        for a, b, entity, start in zip(bounds[:-1], bounds[1:], e[cut].tolist(), s[cut].tolist()):
            window = windows.get((entity, start))
            if window is None:
                window = windows[(entity, start)] = self._new(entity, start, handles[int(source[a])])
            window.spans.append((chunk, a, b))

    def _new(self, entity: int, start: int, first: Any) -> _Window:
        partition, offset = self.position(first)
        window = _Window(start, (partition, offset))
        heapq.heappush(self._firsts.setdefault(partition, []), (offset, entity, start))
        self._starts.setdefault(entity, []).append(start)
        if start < self._oldest[entity]:
            self._oldest[entity] = start
        return window

    def _close(self, uniq: np.ndarray, head: np.ndarray, tail: np.ndarray, wm: np.ndarray, order: np.ndarray,
               handles: list) -> list[Closed]:
        """Close the windows of the batch's entities that their watermark passed, oldest first per entity."""
        reach = self.size + self.lateness
        due = np.flatnonzero(self._oldest[uniq] + reach <= self.watermark[uniq])
        closed = []
        for i in due.tolist():
            entity = int(uniq[i])
            starts, watermark = self._starts[entity], int(self.watermark[entity])
            segment_wm = wm[head[i]:tail[i] + 1]
            starts.sort()
            while starts and starts[0] + reach <= watermark:
                start = starts.pop(0)
                window = self.open.pop((entity, start))
                closer = handles[int(order[head[i] + int(np.searchsorted(segment_wm, start + reach))])]
                closed.append(Closed(self._names[entity], start, window, closer))
                self.emitted_end[entity] = max(int(self.emitted_end[entity]), start + self.size)
            self._oldest[entity] = starts[0] if starts else _UNSET
        return closed

    # -- features of closed windows --------------------------------------------------------
    def features(self, closed: list[Closed]) -> tuple[np.ndarray, np.ndarray]:
        """(reading count, feature rows) of ``closed``, each window's readings in event-time order."""
        spans = [span for c in closed for span in c.window.spans]
        ts = [chunk.ts[a:b] for chunk, a, b in spans]
        counts = np.fromiter((sum(b - a for _, a, b in c.window.spans) for c in closed), dtype=np.int64,
                             count=len(closed))
        bounds = np.concatenate(([0], np.cumsum(counts)))
        all_ts = np.concatenate(ts)
        segment = np.repeat(np.arange(len(closed)), counts)
        by_time = np.lexsort((np.arange(len(all_ts)), all_ts, segment))  # stable: arrival order breaks ties
        values = np.concatenate([chunk.values[a:b] for chunk, a, b in spans])[by_time]
        return counts, compute_windows(self.fs, values, bounds)

    # -- offsets and partitions ------------------------------------------------------------
    def first_open_offset(self, partition: int) -> int | None:
        """The offset of the first reading of the oldest window still open in ``partition``, if any."""
        heap = self._firsts.get(partition)
        while heap:
            offset, entity, start = heap[0]
            window = self.open.get((entity, start))
            if window is not None and window.first == (partition, offset):
                return offset
            heapq.heappop(heap)
        return None

    def forget(self, partitions: set[int]) -> None:
        """Drop every entity of ``partitions`` (revoked: their new owner rebuilds them from the committed offsets)."""
        gone = set(np.flatnonzero(np.isin(self.partition, list(partitions))).tolist())
        if not gone:
            return
        keep = [i for i in range(len(self._names)) if i not in gone]
        remap = {old: new for new, old in enumerate(keep)}
        self.open = {(remap[e], s): w for (e, s), w in self.open.items() if e in remap}
        self._starts = {remap[e]: starts for e, starts in self._starts.items() if e in remap}
        self._firsts = {p: [(o, remap[e], s) for o, e, s in heap if e in remap]
                        for p, heap in self._firsts.items() if p not in partitions}
        for heap in self._firsts.values():
            heapq.heapify(heap)
        self.watermark, self.emitted_end = self.watermark[keep], self.emitted_end[keep]
        self.partition, self._oldest, self._recorded = self.partition[keep], self._oldest[keep], self._recorded[keep]
        self._names = [self._names[i] for i in keep]
        self._index = {name: i for i, name in enumerate(self._names)}


def _segmented_cummax(x: np.ndarray, segment: np.ndarray, head: np.ndarray) -> np.ndarray:
    """The running maximum of ``x`` restarted at each segment (``segment``: ids 0.., ``head``: first index of each)."""
    low, high = int(x.min()), int(x.max())
    span = high - low + 1
    if span * (len(head) + 1) < 2**62:  # lift each segment above the one before: one accumulate for all
        lifted = (x - low) + segment * span
        return np.maximum.accumulate(lifted) - segment * span + low
    out = np.empty_like(x)
    for a, b in zip(head.tolist(), np.append(head[1:], len(x)).tolist()):
        out[a:b] = np.maximum.accumulate(x[a:b])
    return out
