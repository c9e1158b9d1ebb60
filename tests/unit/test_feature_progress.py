"""How far the embedded engine got (``streams.features.progress``): what a restart reads again is told apart from
new readings for as long as it is read again, however the consumer splits it into batches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from streams.features.progress import Progress, progress_key


class RecordedStore:
    """The one call of the online writer that ``Progress.start`` makes: the hash fields of the engine's record."""

    def __init__(self, fields: dict[bytes, bytes]):
        self.layout = SimpleNamespace(feature_view="device_window", project="pm")
        self.fields = fields

    def read_hash(self, key: bytes, fields: list[bytes]) -> list[bytes | None]:
        assert key == progress_key(self.layout)
        return [self.fields.get(f) for f in fields]


def _batch(partition: int, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.arange(first, last + 1, dtype=np.int64)
    return np.full(len(offsets), partition, dtype=np.int64), offsets


def _restarted(mark: int, closed_through: int = 5_000) -> Progress:
    progress = Progress(RecordedStore({b"p:ingest:0": b"%d %d" % (mark, closed_through)}), "ingest", "features")
    assert progress.start([0]) == {0: closed_through}
    return progress


def test_a_rebuild_read_in_several_batches_is_a_reread_up_to_the_mark_in_every_one():
    """Regression: the first batch after a restart cleared the mark, so the rest of the rebuild, read in later
    batches (a consumer returns what it has fetched), counted as new readings: late, and dead-lettered."""
    progress = _restarted(mark=1_000)
    for first, last in ((140, 199), (200, 899), (900, 1_099)):
        partitions, offsets = _batch(0, first, last)
        below = progress.reread(partitions, offsets)
        assert below is not None, (first, last)
        assert below.tolist() == (offsets < 1_000).tolist(), (first, last)
        progress.advance(partitions, offsets)
    assert progress.rebuilt == {0: 1_000 - 140}
    partitions, offsets = _batch(0, 1_100, 1_199)  # caught up: nothing below the mark is read again in this run
    assert progress.reread(partitions, offsets) is None


def test_the_record_after_a_restart_keeps_the_mark_until_the_partition_passes_it():
    """A flush during the rebuild records the mark, not the offset the rebuild has reached: a second crash then
    still tells the readings below the first mark from new ones."""
    progress = _restarted(mark=1_000)
    partitions, offsets = _batch(0, 140, 499)
    progress.reread(partitions, offsets)
    progress.advance(partitions, offsets)
    progress.dead_lettered([0])
    windows = SimpleNamespace(partitions={0}, closed_through=lambda p: 5_000)
    assert progress.fields(windows) == {b"p:ingest:0": b"1000 5000"}
    partitions, offsets = _batch(0, 500, 1_199)
    progress.reread(partitions, offsets)
    progress.advance(partitions, offsets)
    progress.dead_lettered([0])
    assert progress.fields(windows) == {b"p:ingest:0": b"1200 5000"}


def test_a_partition_without_a_record_reads_nothing_as_a_reread():
    progress = Progress(RecordedStore({}), "ingest", "features")
    assert progress.start([0]) == {0: -1}
    partitions, offsets = _batch(0, 0, 99)
    assert progress.reread(partitions, offsets) is None
    progress.advance(partitions, offsets)
    assert progress.rebuilt == {}
