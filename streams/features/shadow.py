"""Shadow feature sets: a new version computed beside the live one, compared, never served.

The embedded engine feeds every reading to the shadow version's windows as well. When a
window of both versions has closed, the two rows are compared feature by feature (the
features both versions declare, within a relative tolerance); the outcome is counted in
``tangram_features_shadow_rows_total{result}`` (``same``, ``different``, ``unmatched``: a
window only one version produced) and differing rows are sampled to the shadow topic as
JSON. Shadow rows never reach the features topic nor the online store. Promotion is a
topology change: point ``feature_set`` at the new declaration.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any

from prometheus_client import Counter

from streams.features.compute import PartitionWindows
from streams.features.spec import FeatureSet

SHADOW_ROWS = Counter("tangram_features_shadow_rows_total", "Shadow feature-set windows compared with the live ones.",
                      ["processor", "result"])

Key = tuple[str, int, int]  # entity, window start, window end


class ShadowComparator:
    """Computes the shadow version's windows and compares them with the live rows."""

    def __init__(self, live: FeatureSet, shadow: FeatureSet, processor: str, rel_tol: float = 1e-9, keep: int = 50_000):
        self.live_fs, self.fs = live, shadow
        self.processor = processor
        self.rel_tol = rel_tol
        self.keep = keep
        self.common = [f for f in shadow.feature_names if f in live.feature_names]
        self.partitions: dict[Any, PartitionWindows] = {}
        self._live: OrderedDict[Key, dict] = OrderedDict()
        self._shadow: OrderedDict[Key, dict] = OrderedDict()

    def add(self, entity: str, ts: int, row: list[float], position: Any) -> list[dict]:
        """Feed one reading (``position``: its (TopicPartition, offset)); returns the differences of the windows
        that can now be compared."""
        partition = position[0]
        state = self.partitions.get(partition)
        if state is None:
            state = self.partitions[partition] = PartitionWindows(self.fs)
        _, closed = state.add(entity, ts, row, position)
        return self._paired(closed)

    def close_partition(self, partition: Any) -> list[dict]:
        """The live engine closed ``partition``'s windows (it went quiet): the shadow version's close too."""
        state = self.partitions.get(partition)
        return self._paired(state.close_all()) if state is not None else []

    def _paired(self, closed: list[dict]) -> list[dict]:
        out = []
        for window in closed:
            key = (window["entity"], window["window_start"], window["window_end"])
            out.extend(self._pair(key, shadow=window))
        return out

    def live(self, entity: str, row: dict) -> list[dict]:
        """Record a live row the engine emitted; returns its difference if its shadow twin is there."""
        return self._pair((entity, row["window_start"], row["window_end"]), live=row)

    def open_positions(self) -> list[Any]:
        return [w.first for state in self.partitions.values() for w in state.open.values()]

    def _pair(self, key: Key, live: dict | None = None, shadow: dict | None = None) -> list[dict]:
        mine, other = (self._live, self._shadow) if live is not None else (self._shadow, self._live)
        twin = other.pop(key, None)
        if twin is None:
            mine[key] = live if live is not None else shadow
            while len(mine) > self.keep:  # its twin never came: a window only one version produced
                mine.popitem(last=False)
                SHADOW_ROWS.labels(self.processor, "unmatched").inc()
            return []
        live_row, shadow_row = (live, twin) if live is not None else (twin, shadow)
        differences = {f: [live_row[f], shadow_row[f]] for f in self.common
                       if not math.isclose(live_row[f], shadow_row[f], rel_tol=self.rel_tol, abs_tol=1e-12)}
        SHADOW_ROWS.labels(self.processor, "different" if differences else "same").inc()
        if not differences:
            return []
        return [{"feature_set": self.fs.name, "live_version": self.live_fs.version, "shadow_version": self.fs.version,
                 "entity": key[0], "window_start": key[1], "window_end": key[2], "differences": differences}]


def encode(difference: dict) -> bytes:
    return json.dumps(difference, sort_keys=True).encode()
