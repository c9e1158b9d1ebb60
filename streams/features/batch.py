"""The embedded engine's window state, updated a micro-batch at a time with numpy.

:class:`BatchWindows` holds the event-time windows of every partition one processor reads and takes
a whole decoded batch per call: which readings are late, which windows they join, which windows
close, all computed with array operations over the batch; Python runs once per (entity, window)
group of the batch and once per window closed, never once per reading. Its decisions are those of
:class:`streams.features.compute.PartitionWindows`, the per-reading state machine the other engines
run (``tests/unit/test_features.py`` feeds both the same readings): per partition, a window
``[start, start + size)`` of any entity closes when the partition's stream time (its newest event
time) reaches ``end + allowed_lateness``; a reading whose windows are all closed is late.

A closed window's features come from :func:`streams.features.compute.compute_windows`, for every
window a batch closed in one call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
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
    """A window that closed: its entity and start, its readings, and the reading whose event time closed it
    (``None`` when its partition went quiet: ``BatchWindows.close_partition``)."""

    entity: str
    start: int
    window: _Window
    closer: Any


class Batch(NamedTuple):
    """What one batch did, per reading in input order: late (a dead letter), or a re-read of one already
    counted before a restart (left out, counted); and which windows closed."""

    late: np.ndarray
    reread: np.ndarray
    closed: list[Closed]


class _Partition:
    """The event-time state of one partition: stream time, closed windows, open windows by end."""

    __slots__ = ("stream_time", "closed_through", "ends")

    def __init__(self, closed_through: int, lateness: int):
        self.closed_through = closed_through  # every window ending here or before is closed
        self.stream_time = closed_through + lateness if closed_through >= 0 else -1
        self.ends: list[tuple[int, int, int]] = []  # heap of (end, entity, start) of the open windows


class BatchWindows:
    """Per-partition event-time windows of every entity one processor reads, fed a batch at a time."""

    def __init__(self, fs: FeatureSet, offset: Callable[[Any], int]):
        """``offset(handle)``: the offset of a reading in its partition, from the handle the engine passes with it."""
        self.fs = fs
        self.offset = offset
        w = fs.window
        self.size, self.hop, self.lateness = w.size_ms, w.hop_ms, w.allowed_lateness_ms
        self.per_reading = w.size_ms // w.hop_ms  # windows each reading belongs to
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self.partitions: dict[int, _Partition] = {}
        self.open: dict[tuple[int, int], _Window] = {}  # (entity, start) → window
        self._firsts: dict[int, list[tuple[int, int, int]]] = {}  # partition → heap of (offset, entity, start)

    # -- entities and partitions -----------------------------------------------------------
    def ids(self, entities: list[str]) -> np.ndarray:
        """The ids of ``entities`` (each seen for the first time gets the next one)."""
        index, names = self._index, self._names
        out = np.empty(len(entities), dtype=np.int64)
        for i, entity in enumerate(entities):
            got = index.get(entity)
            if got is None:
                got = index[entity] = len(names)
                names.append(entity)
            out[i] = got
        return out

    def unknown(self, partitions: np.ndarray) -> list[int]:
        """The partitions of ``partitions`` not seen since start (or since they were revoked)."""
        return sorted(set(np.unique(partitions).tolist()) - self.partitions.keys())

    def start(self, partition: int, closed_through: int = -1) -> None:
        """Track ``partition``: every window ending at ``closed_through`` or before is closed (a restart's record)."""
        self.partitions[partition] = _Partition(closed_through, self.lateness)

    def closed_through(self, partition: int) -> int:
        """The end of the newest window closed in ``partition``: every window ending there or before is closed.

        Window ends are multiples of the hop, so this one number says what the stream time says of every
        window (closed iff ``end + allowed_lateness <= stream time``), and it moves once per hop of event
        time: it is what a restart needs (``streams.features.progress``).
        """
        state = self.partitions[partition]
        reached = (state.stream_time - self.lateness) // self.hop * self.hop if state.stream_time >= 0 else -1
        return max(state.closed_through, reached)

    # -- one batch -------------------------------------------------------------------------
    def add(self, entities: np.ndarray, partitions: np.ndarray, ts: np.ndarray, values: np.ndarray, handles: list,
            reread: np.ndarray | None = None, excluded: np.ndarray | None = None) -> Batch:
        """Add a batch of readings (arrival order): ``entities`` from :meth:`ids`, their partitions (each started),
        event times, input values (rows × inputs, NaN = missing), and each reading's handle.

        ``reread`` marks the readings processed before a restart (below the offset its progress recorded):
        those of windows still open rebuild them; the others were counted in a window emitted before, or
        dead-lettered then, and are left out as re-reads rather than called late.
        ``excluded`` marks readings that move their partition's stream time and are judged late or not, but
        join no window (an entity table's filter left them out of the stream).
        """
        n = len(ts)
        if n == 0:
            return Batch(np.zeros(0, dtype=bool), np.zeros(0, dtype=bool), [])
        order = np.argsort(partitions, kind="stable")  # by partition, arrival order within each
        part, t = partitions[order], ts[order]
        head = np.flatnonzero(np.concatenate(([True], part[1:] != part[:-1])))
        segment = np.repeat(np.arange(len(head)), np.diff(np.append(head, n)))
        states = [self.partitions[p] for p in part[head].tolist()]
        before = np.array([s.stream_time for s in states], dtype=np.int64)
        closed_through = np.array([s.closed_through for s in states], dtype=np.int64)
        # the partition's stream time once each reading is counted: its newest event time so far
        stream = _segmented_cummax(np.maximum(t, before[segment]), segment, head)
        last = t - t % self.hop
        candidates = last[:, None] - np.arange(self.per_reading)[None, :] * self.hop  # every window start
        ends = candidates + self.size
        takes = (ends + self.lateness > stream[:, None]) & (ends > closed_through[segment][:, None])
        refused = np.empty(n, dtype=bool)
        refused[order] = ~takes.any(axis=1)
        again = refused & reread if reread is not None else np.zeros(n, dtype=bool)
        if excluded is not None:
            takes &= ~excluded[order][:, None]
        self._join(entities[order], part, candidates, takes, order, t, values, handles)
        tails = np.append(head[1:], n) - 1
        closed = []
        for state, a, b in zip(states, head.tolist(), tails.tolist()):
            state.stream_time = int(stream[b])
            closed += self._close(state, stream[a:b + 1], order[a:b + 1], handles)
        return Batch(refused & ~again, again, closed)

    def _join(self, ent: np.ndarray, part: np.ndarray, candidates: np.ndarray, takes: np.ndarray, order: np.ndarray,
              t: np.ndarray, values: np.ndarray, handles: list) -> None:
        """Append each accepted reading to its windows: one span per (entity, window) of the batch."""
        row, j = np.nonzero(takes)  # row-major: (partition, arrival) order, then window
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
        for a, b, entity, start, partition in zip(bounds[:-1], bounds[1:], e[cut].tolist(), s[cut].tolist(),
                                                  part[row[cut]].tolist()):
            window = windows.get((entity, start))
            if window is None:
                window = windows[(entity, start)] = self._new(entity, start, partition, handles[int(source[a])])
            window.spans.append((chunk, a, b))

    def _new(self, entity: int, start: int, partition: int, first: Any) -> _Window:
        offset = self.offset(first)
        window = _Window(start, (partition, offset))
        heapq.heappush(self._firsts.setdefault(partition, []), (offset, entity, start))
        heapq.heappush(self.partitions[partition].ends, (start + self.size, entity, start))
        return window

    def _close(self, state: _Partition, stream: np.ndarray, arrivals: np.ndarray, handles: list) -> list[Closed]:
        """Close the windows of one partition that its stream time passed, each with the reading that closed it
        (``stream``: the partition's stream time at each of its readings of the batch, ``arrivals``: their
        indexes into the batch)."""
        ends, closed = state.ends, []
        while ends and ends[0][0] + self.lateness <= state.stream_time:
            end, entity, start = heapq.heappop(ends)
            window = self.open.pop((entity, start))
            closer = handles[int(arrivals[int(np.searchsorted(stream, end + self.lateness))])]
            closed.append(Closed(self._names[entity], start, window, closer))
            state.closed_through = max(state.closed_through, end)
        return closed

    def close_partition(self, partition: int) -> list[Closed]:
        """Close every open window of ``partition`` (it went quiet): its stream time moves past them."""
        state = self.partitions[partition]
        if not state.ends:
            return []
        state.stream_time = max(state.stream_time, max(end for end, _, _ in state.ends) + self.lateness)
        closed = []
        while state.ends:
            end, entity, start = heapq.heappop(state.ends)
            closed.append(Closed(self._names[entity], start, self.open.pop((entity, start)), None))
            state.closed_through = max(state.closed_through, end)
        return closed

    def has_open(self, partition: int) -> bool:
        state = self.partitions.get(partition)
        return state is not None and bool(state.ends)

    # -- features of closed windows --------------------------------------------------------
    def features(self, closed: list[Closed]) -> tuple[np.ndarray, np.ndarray]:
        """(reading count, feature rows) of ``closed``, each window's readings in event-time order.

        A window holds a span per batch that brought it readings: at a low rate that is a span per reading
        or two, tens of thousands for the windows one stream-time step closes at once. The spans are
        gathered with array operations (one pass of Python over them, in ``zip`` and ``map``), never a
        slice per span.
        """
        per_window = np.fromiter((len(c.window.spans) for c in closed), dtype=np.int64, count=len(closed))
        chunks, begins, ends = zip(*(span for c in closed for span in c.window.spans))
        begin = np.array(begins, dtype=np.int64)
        length = np.array(ends, dtype=np.int64) - begin
        # the distinct chunks, laid end to end: a span's rows are ``base[its chunk] + begin .. + length``
        ids = np.fromiter(map(id, chunks), dtype=np.int64, count=len(chunks))
        _, first, which = np.unique(ids, return_index=True, return_inverse=True)
        distinct = [chunks[i] for i in first.tolist()]
        sizes = np.fromiter((len(chunk.ts) for chunk in distinct), dtype=np.int64, count=len(distinct))
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        counts = np.add.reduceat(length, np.concatenate(([0], np.cumsum(per_window)[:-1]))) if len(closed) else length
        bounds = np.concatenate(([0], np.cumsum(counts)))
        total = int(bounds[-1])
        span_at = np.concatenate(([0], np.cumsum(length)[:-1]))  # each span's first row in the gathered arrays
        rows = np.repeat(base[which] + begin - span_at, length) + np.arange(total)
        all_ts = np.concatenate([chunk.ts for chunk in distinct])[rows]
        segment = np.repeat(np.arange(len(closed)), counts)
        by_time = np.lexsort((np.arange(total), all_ts, segment))  # stable: arrival order breaks ties
        values = np.concatenate([chunk.values for chunk in distinct])[rows][by_time]
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
        """Drop the windows of ``partitions`` (revoked: their new owner rebuilds them from the committed offsets)."""
        for p in partitions:
            state = self.partitions.pop(p, None)
            for _, entity, start in state.ends if state is not None else ():
                self.open.pop((entity, start), None)
            self._firsts.pop(p, None)


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
