"""The embedded engine's window state, updated a micro-batch at a time with numpy.

:class:`BatchWindows` holds the event-time windows of every partition one processor reads and takes
a whole decoded batch per call: which readings are late, which windows they join, which windows
close, all computed with array operations over the batch; Python runs once per (entity, window)
group of the batch and once per window closed, never once per reading. Its decisions are those of
:class:`streams.features.compute.PartitionWindows`, the per-reading state machine the other engines
run (``tests/unit/test_features.py`` feeds both the same readings): per partition, a window
``[start, start + size)`` of any entity closes when the partition's stream time (its newest event
time) reaches ``end + allowed_lateness``; a reading whose windows are all closed is late.

The readings of the open windows are kept in columns (:class:`_Rows`: a row per reading and window,
with the window's slot), so the windows a stream-time step closes at once — every entity's, when
windows are aligned to the epoch — are gathered in one pass of array operations, and their features
come from :func:`streams.features.compute.compute_windows` in one call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from streams.features.compute import compute_windows
from streams.features.spec import FeatureSet


class _Rows:
    """The accepted readings of every open window, one row per (reading, window), in columns: the window's
    slot, the event time, the input values. Appended a batch at a time; a window's rows are in arrival
    order. The rows of closed windows go in one array pass (``compact``), never a Python step per reading."""

    __slots__ = ("slot", "ts", "values", "n")

    def __init__(self, inputs: int, capacity: int = 4096):
        self.slot = np.empty(capacity, dtype=np.int64)
        self.ts = np.empty(capacity, dtype=np.int64)
        self.values = np.empty((capacity, inputs), dtype=np.float64)
        self.n = 0

    def append(self, slot: np.ndarray, ts: np.ndarray, values: np.ndarray) -> None:
        n, k = self.n, len(slot)
        if n + k > len(self.slot):
            capacity = max(2 * len(self.slot), n + k)
            for name in ("slot", "ts", "values"):
                old = getattr(self, name)
                new = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
                new[:n] = old[:n]
                setattr(self, name, new)
        self.slot[n:n + k], self.ts[n:n + k], self.values[n:n + k] = slot, ts, values
        self.n = n + k

    def compact(self, gone: np.ndarray) -> None:
        """Drop the rows of the slots ``gone`` marks (a boolean per slot id)."""
        n = self.n
        keep = ~gone[self.slot[:n]]
        m = int(keep.sum())
        if m < n:
            self.slot[:m], self.ts[:m], self.values[:m] = self.slot[:n][keep], self.ts[:n][keep], self.values[:n][keep]
            self.n = m


class Closed(NamedTuple):
    """A window that closed: its entity and start, where its readings are (``BatchWindows.features``), the handle
    of its newest reading (the engine's Record: headers of the output), and the reading whose event time closed
    it (``None`` when its partition went quiet: ``BatchWindows.close_partition``)."""

    entity: str
    start: int
    slot: int
    last: Any
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
        self.open: dict[tuple[int, int], int] = {}  # (entity, start) → the window's slot
        self.rows = _Rows(len(fs.inputs))  # the open windows' readings, each row with its window's slot
        self._first: list[tuple[int, int] | None] = []  # slot → (partition, offset) of the window's first reading
        self._last: list[Any] = []  # slot → the handle of the window's newest reading
        self._free: list[int] = []  # slots of windows closed before the last compaction
        self._closing: list[int] = []  # slots closed (or forgotten) since: their rows are still there to read
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
        self._compact()  # the windows closed by the call before are read (``features``) by now
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
        keys = list(zip(e[cut].tolist(), s[cut].tolist()))
        slots = list(map(self.open.get, keys))
        if None in slots:  # the batch opened windows
            parts, firsts = part[row[cut]].tolist(), source[cut].tolist()
            for i, slot in enumerate(slots):
                if slot is None:
                    slots[i] = self._new(*keys[i], parts[i], handles[firsts[i]])
        ends = np.append(cut[1:], len(row))
        last = self._last
        for slot, newest in zip(slots, source[ends - 1].tolist()):
            last[slot] = handles[newest]
        self.rows.append(np.repeat(np.array(slots, dtype=np.int64), ends - cut), t[row], values[source])

    def _new(self, entity: int, start: int, partition: int, first: Any) -> int:
        offset = self.offset(first)
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._first)
            self._first.append(None)
            self._last.append(None)
        self._first[slot] = (partition, offset)
        self.open[(entity, start)] = slot
        heapq.heappush(self._firsts.setdefault(partition, []), (offset, entity, start))
        heapq.heappush(self.partitions[partition].ends, (start + self.size, entity, start))
        return slot

    def _closed(self, entity: int, start: int, closer: Any) -> Closed:
        slot = self.open.pop((entity, start))
        self._closing.append(slot)
        return Closed(self._names[entity], start, slot, self._last[slot], closer)

    def _compact(self) -> None:
        """Drop the rows of the windows closed since the last call and free their slots."""
        if not self._closing:
            return
        gone = np.zeros(len(self._first), dtype=bool)
        gone[self._closing] = True
        self.rows.compact(gone)
        for slot in self._closing:
            self._last[slot] = None  # the reading's record goes with its window
        self._free += self._closing
        self._closing = []

    def _close(self, state: _Partition, stream: np.ndarray, arrivals: np.ndarray, handles: list) -> list[Closed]:
        """Close the windows of one partition that its stream time passed, each with the reading that closed it
        (``stream``: the partition's stream time at each of its readings of the batch, ``arrivals``: their
        indexes into the batch)."""
        ends, closed = state.ends, []
        while ends and ends[0][0] + self.lateness <= state.stream_time:
            end, entity, start = heapq.heappop(ends)
            closer = handles[int(arrivals[int(np.searchsorted(stream, end + self.lateness))])]
            closed.append(self._closed(entity, start, closer))
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
            closed.append(self._closed(entity, start, None))
            state.closed_through = max(state.closed_through, end)
        return closed

    def has_open(self, partition: int) -> bool:
        state = self.partitions.get(partition)
        return state is not None and bool(state.ends)

    # -- features of closed windows --------------------------------------------------------
    def features(self, closed: list[Closed]) -> tuple[np.ndarray, np.ndarray]:
        """(reading count, feature rows) of ``closed``, each window's readings in event-time order (arrival order
        breaks ties), from the windows the last :meth:`add` or :meth:`close_partition` calls closed: the next
        ``add`` drops their readings.

        One pass of array operations over the open windows' rows, whatever the number of windows or of the
        batches that brought their readings.
        """
        slots = np.fromiter((c.slot for c in closed), dtype=np.int64, count=len(closed))
        if not set(slots.tolist()) <= set(self._closing):
            raise ValueError("features of windows closed before the last add(): their readings are gone")
        where = np.full(len(self._first), -1, dtype=np.int64)
        where[slots] = np.arange(len(slots))
        rows = self.rows
        window = where[rows.slot[:rows.n]]
        taken = np.flatnonzero(window >= 0)
        window = window[taken]
        by_time = taken[np.lexsort((rows.ts[taken], window))]  # stable: arrival order breaks ties
        counts = np.bincount(window, minlength=len(slots))
        bounds = np.concatenate(([0], np.cumsum(counts)))
        return counts, compute_windows(self.fs, rows.values[by_time], bounds)

    # -- offsets and partitions ------------------------------------------------------------
    def first_open_offset(self, partition: int) -> int | None:
        """The offset of the first reading of the oldest window still open in ``partition``, if any."""
        heap = self._firsts.get(partition)
        while heap:
            offset, entity, start = heap[0]
            slot = self.open.get((entity, start))
            if slot is not None and self._first[slot] == (partition, offset):
                return offset
            heapq.heappop(heap)
        return None

    def forget(self, partitions: set[int]) -> None:
        """Drop the windows of ``partitions`` (revoked: their new owner rebuilds them from the committed offsets)."""
        for p in partitions:
            state = self.partitions.pop(p, None)
            for _, entity, start in state.ends if state is not None else ():
                if (slot := self.open.pop((entity, start), None)) is not None:
                    self._closing.append(slot)  # its rows go at the next compaction
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
