"""The declared enrichment of a feature set (``enrichment:``), executed over its entity table.

Per batch of readings (:meth:`Join.readings`): each reading joins its entity's version in effect at its
event time; an entity with none is dead-lettered (``unknown_entity``) or joins the declared defaults; a
reading whose entity fails ``keep`` leaves the stream before any window, counted by attribute and value
(``tangram_features_filtered_total``); a null input declared in ``fill`` takes its attribute's value.
Lateness comes first: a late reading is dead-lettered as late whatever its entity, and every reading,
kept or not, moves its partition's stream time (as in the Flink job, whose lateness is decided before
its temporal join).
Per closed window (:meth:`Join.attributes`): the attributes in effect at the window's last instant,
encoded in declaration order and appended to its aggregates.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import NamedTuple

import numpy as np
from prometheus_client import Counter

from streams.features.spec import FeatureSet
from streams.features.table import VersionedTable

#: Readings that left the stream by the feature set's ``keep`` (``tangram demo`` reads it back from the metrics).
FILTERED_METRIC = "tangram_features_filtered_total"
FILTERED = Counter(FILTERED_METRIC, "Readings that left the stream by the feature set's `keep`.",
                   ["processor", "attribute", "value"])


class Verdicts(NamedTuple):
    """What the join made of each reading of a batch."""

    keep: np.ndarray  # joins its windows
    unknown: np.ndarray  # no version of its entity in effect (and no defaults): a dead letter
    failed: dict[int, tuple[str, str]]  # filtered: index → (attribute, value) it failed `keep` on


class Join:
    def __init__(self, fs: FeatureSet, table: VersionedTable, processor: str):
        spec = fs.enrichment
        assert spec is not None
        self.spec, self.table, self.processor = spec, table, processor
        at = {name: i for i, name in enumerate(table.fields)}
        self._keep = [(name, at[name], frozenset(values)) for name, values in spec.keep.items()]
        self._fill = [(fs.inputs.index(field), at[attribute]) for field, attribute in spec.fill.items()]
        self._attributes = [(attribute, at[attribute.name]) for attribute in spec.attributes]
        self._width = len(fs.attribute_names)
        self._defaults = (tuple(spec.defaults.get(name) for name in table.fields)
                          if spec.missing == "defaults" else None)
        self._size = fs.window.size_ms

    def readings(self, entities: list[str], ts: np.ndarray, values: np.ndarray) -> Verdicts:
        """Join a batch in place (``values`` filled): which readings stay, which are of unknown entities (to
        dead-letter), and the attribute and value each filtered one failed (counted by :meth:`count`)."""
        table, defaults = self.table, self._defaults
        rows = [table.at(entity, t) for entity, t in zip(entities, ts.tolist())]
        unknown = np.zeros(len(rows), dtype=bool)
        failed: dict[int, tuple[str, str]] = {}
        for i, row in enumerate(rows):
            if row is None:
                if defaults is None:
                    unknown[i] = True
                    continue
                row = rows[i] = defaults
            for name, j, allowed in self._keep:
                if row[j] not in allowed:
                    failed[i] = (name, str(row[j]))
                    break
        filtered = np.zeros(len(rows), dtype=bool)
        filtered[list(failed)] = True
        keep = ~(unknown | filtered)
        for column, j in self._fill:
            for i in np.flatnonzero(np.isnan(values[:, column]) & keep).tolist():
                if (value := rows[i][j]) is not None:  # type: ignore[index]
                    values[i, column] = float(value)
        return Verdicts(keep, unknown, failed)

    def count(self, verdicts: Verdicts, late: np.ndarray) -> None:
        """Count the filtered readings that were not late (a late one is dead-lettered as late, whatever its entity)."""
        tally = Tally(reason for i, reason in verdicts.failed.items() if not late[i])
        for (name, value), count in tally.items():
            FILTERED.labels(self.processor, name, value).inc(count)

    def attributes(self, windows: list[tuple[str, int]]) -> np.ndarray:
        """The encoded attributes of each (entity, window start): those in effect at the window's last instant
        (the defaults, or zeros and NaN, for an entity with none then)."""
        out = np.empty((len(windows), self._width))
        for i, (entity, start) in enumerate(windows):
            row = self.table.at(entity, start + self._size - 1) or self._defaults
            out[i] = [x for attribute, j in self._attributes
                      for x in attribute.encode(row[j] if row is not None else None)]
        return out
