"""How far the embedded engine got, kept beside its rows so that a restart tells re-reads from late data.

At-least-once means a restarted engine reads again from the committed offsets, and those stay behind
the first reading of every window still open (``committable``). Some of what it reads again belongs
to windows it emitted before it stopped. Without a record of how far it got, the engine could only
call those readings late, and dead-letter good data (issue 21: 9,000 readings of one ``kill -9``).

:class:`Progress` keeps that record in one Redis hash per engine (``tangram:features:<view>:<project>``),
written by the last command of the round trip that writes the batch's rows (``OnlineWriter.flush``), after
the broker has acknowledged the batch's outputs: so it never claims more than was delivered and written.

- ``p:<topic>:<partition>`` → ``"<mark> <closed_through>"``: the offset below which every reading of the
  partition was processed and its outputs (windows, dead letters) acknowledged, and the end of the
  newest window closed there (``BatchWindows.closed_through``: every window ending there or before is
  closed; it moves once per hop of event time).

A partition is recorded at the flush of a batch that moved its closed windows, dead-lettered one of its
readings, or closed it quiet; a batch that did none of these (most batches between two window ends) costs
no Redis round trip. What was processed after a partition's record then belongs to windows still open
(no window closed since), and is read again as new after a restart: it rebuilds them, as a re-read would.

On start, a partition resumes from its record (its stream time as far as its closed windows say), and
a reading below its mark is a **re-read**: one of a window still open rebuilds it (it was accepted the
first time: its window was open then, as it still is); one of a window already closed was counted in a
window emitted before, or dead-lettered then, and is left out and counted, never dead-lettered again.
Readings from the mark on are new. A batch acknowledged but not recorded before the crash is read again
as new: its windows come out a second time, identical (at-least-once).

How much a restart re-reads is bounded by the committed offsets: per partition, the readings from the
first reading of the oldest window still open (at most window size + allowed lateness of event time,
or the idle timeouts, behind) up to the mark. ``tangram_features_rebuild_records_total`` counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from prometheus_client import Counter

from streams.features.batch import BatchWindows
from streams.features.layout import FeastLayout
from streams.features.online import OnlineWriter

log = logging.getLogger("tangram.features")

REBUILD = Counter("tangram_features_rebuild_records_total",
                  "Readings read again after a restart, below the offset the engine had processed (state rebuild).",
                  ["processor"])
REREAD = Counter("tangram_features_reread_records_total",
                 "Re-read readings of windows emitted (or readings dead-lettered) before a restart: left out, "
                 "not late.", ["processor"])


def progress_key(layout: FeastLayout) -> bytes:
    """The engine's progress hash for one feature view of one Feast project (beside Feast's own keys). It ends
    with the project, as Feast's keys do, so a secured stack's per-app Redis user (``~*<project>``,
    :func:`streams.security.acls.redis_rules`) may write it."""
    return f"tangram:features:{layout.feature_view}:{layout.project}".encode()


class Progress:
    """The record of the partitions one engine reads: marks and closed windows (see the module)."""

    def __init__(self, store: OnlineWriter, topic: str, processor: str):
        self.store = store
        self.topic = topic
        self.processor = processor
        self.key = progress_key(store.layout)
        self._marks: dict[int, int] = {}  # partition → offset below which readings were processed before
        self._positions: dict[int, int] = {}  # partition → next offset to record
        self._changed: set[int] = set()  # partitions that moved since their record
        self._due: set[int] = set()  # partitions recorded at the next flush whatever their windows did
        self._recorded: dict[int, int] = {}  # partition → the closed_through of its record
        #: Readings read again below the marks since start, per partition (the rebuild's size).
        self.rebuilt: dict[int, int] = {}

    def _field(self, partition: int) -> bytes:
        return f"p:{self.topic}:{partition}".encode()

    def start(self, partitions: list[int]) -> dict[int, int]:
        """Read the record of partitions first seen since start; returns each one's closed_through (-1: none)."""
        closed = {}
        for p, raw in zip(partitions, self.store.read_hash(self.key, [self._field(p) for p in partitions])):
            mark, closed[p] = (int(x) for x in raw.split()) if raw else (-1, -1)
            self._marks[p] = mark
            self._recorded[p] = closed[p]
            if mark > 0:
                self._positions[p] = mark
                log.info("%s: %s[%d] was processed up to offset %d before this start: readings below it "
                         "rebuild open windows or are re-reads", self.processor, self.topic, p, mark)
        return closed

    def reread(self, partitions: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
        """Which readings of a batch lie below their partition's mark (``None``: none can)."""
        if not any(self._marks.get(p, -1) > 0 for p in np.unique(partitions).tolist()):
            return None
        marks = np.array([self._marks[p] for p in partitions.tolist()], dtype=np.int64)
        below = offsets < marks
        if below.any():
            counts = np.bincount(partitions[below])
            for p in np.flatnonzero(counts).tolist():
                self.rebuilt[p] = self.rebuilt.get(p, 0) + int(counts[p])
            REBUILD.labels(self.processor).inc(int(below.sum()))
        return below

    def advance(self, partitions: np.ndarray, offsets: np.ndarray) -> None:
        """A batch was processed: its positions go into the next flush."""
        last = np.full(int(partitions.max()) + 1, -1, dtype=np.int64)
        np.maximum.at(last, partitions, offsets)
        for p in np.flatnonzero(last >= 0).tolist():
            reached = int(last[p]) + 1
            self._positions[p] = max(self._positions.get(p, 0), reached)  # the mark, until the rebuild passes it
            self._changed.add(p)
            if reached >= self._marks.get(p, -1) > 0:
                log.info("%s: %s[%d] caught up with its mark: %d readings read again to rebuild its state",
                         self.processor, self.topic, p, self.rebuilt.get(p, 0))
                self._marks[p] = -1  # nothing below the mark is read again in this run

    def closed(self, partition: int) -> None:
        """Windows of ``partition`` closed without a new reading (it went quiet): record it at the next flush."""
        self._changed.add(partition)
        self._due.add(partition)

    def dead_lettered(self, partitions: Iterable[int]) -> None:
        """Readings of ``partitions`` went to the DLQ: record them at the next flush, so that a restart leaves
        those readings out as re-reads instead of dead-lettering them a second time."""
        self._due.update(partitions)

    def fields(self, windows: BatchWindows) -> dict[bytes, bytes]:
        """What the next flush records: position and closed windows of each partition that moved and is due
        (closed windows moved, readings dead-lettered, gone quiet); the others wait for a later flush."""
        out = {}
        for p in [p for p in self._changed if p in self._due or p not in windows.partitions
                  or windows.closed_through(p) != self._recorded.get(p)]:
            self._changed.discard(p)
            if p in windows.partitions:
                self._recorded[p] = closed = windows.closed_through(p)
                out[self._field(p)] = b"%d %d" % (self._positions.get(p, 0), closed)
        self._due.clear()
        return out

    def forget(self, partitions: set[int]) -> None:
        """Revoked partitions: their record is read again if they come back (their new owner moved them on)."""
        for p in partitions:
            self._marks.pop(p, None)
            self._positions.pop(p, None)
            self._changed.discard(p)
            self._due.discard(p)
            self._recorded.pop(p, None)
