"""The declaration of a feature set: one YAML file, one typed, frozen model.

A feature set names its entity (the Kafka key), its source and output topics, its
event-time window (size, hop, allowed lateness), its aggregations in output order,
the valid range of every input and feature, its online TTL and its owner. The
feature names, their order and their ranges are all derived
from it, so the engines, the training script, the Avro contract and the online store
cannot drift apart.

This module imports only pydantic and PyYAML: the Flink job environment loads it too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache, cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streams.yamlfile import load_model

Stat = Literal["mean", "std", "min", "max", "ptp"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Entity(_Model):
    """What the features describe; ``join_key`` is the Kafka key and the online store's key."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    join_key: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str = ""


class SourceSpec(_Model):
    topic: str = Field(description="The ingest topic the engines read (Avro, keyed by the entity).")
    schema_: str = Field(alias="schema", description="Avro subject of the input records.")
    timestamp_field: str = Field(description="Event time of a record, epoch milliseconds.")

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class OutputSpec(_Model):
    topic: str = Field(description="Where every engine writes one record per entity and window.")
    schema_: str = Field(alias="schema", description="Avro subject of the output records.")

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class WindowSpec(_Model):
    """Event-time windows per entity: ``[start, start + size_ms)`` every ``hop_ms``."""

    size_ms: int = Field(ge=100, description="Window length.")
    hop_ms: int = Field(ge=100, description="Distance between window starts; equal to size_ms for tumbling windows.")
    allowed_lateness_ms: int = Field(0, ge=0, description="How long after its end a window waits for stragglers.")

    @model_validator(mode="after")
    def _hop_divides_size(self) -> WindowSpec:
        if self.hop_ms > self.size_ms or self.size_ms % self.hop_ms:
            raise ValueError(f"hop_ms ({self.hop_ms}) must divide size_ms ({self.size_ms})")
        return self

    def starts(self, ts: int) -> list[int]:
        """Starts of every window holding event time ``ts``, oldest first."""
        last = ts - ts % self.hop_ms
        return [s for s in range(last - self.size_ms + self.hop_ms, last + 1, self.hop_ms)]


class Aggregation(_Model):
    """One group of output features, in declaration order.

    ``missing_rate``: share of null values over ``inputs`` (one feature);
    ``stats``: ``<input>_<stat>`` for each input and stat;
    ``band_energy``: share of an input's spectral energy at or above ``cut_hz`` (``<input>_band_energy``).
    """

    kind: Literal["missing_rate", "stats", "band_energy"]
    inputs: tuple[str, ...] = Field(min_length=1)
    stats: tuple[Stat, ...] = ()
    cut_hz: float | None = Field(None, gt=0)
    range_: tuple[float, float] | None = Field(None, alias="range", description="Valid range of the features.")

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _shape(self) -> Aggregation:
        if (self.kind == "stats") != bool(self.stats):
            raise ValueError("`stats:` is required for, and only for, kind `stats`")
        if (self.kind == "band_energy") != (self.cut_hz is not None):
            raise ValueError("`cut_hz:` is required for, and only for, kind `band_energy`")
        if self.kind == "band_energy" and len(self.inputs) != 1:
            raise ValueError("band_energy takes exactly one input")
        return self

    def names(self) -> list[str]:
        if self.kind == "missing_rate":
            return ["missing_rate"]
        if self.kind == "stats":
            return [f"{i}_{s}" for i in self.inputs for s in self.stats]
        return [f"{self.inputs[0]}_band_energy"]


class TableAttribute(_Model):
    """A table attribute appended to the feature vector: a number as it is, or a category one-hot over
    ``one_hot`` (in that order; a value outside it is all zeros)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    one_hot: tuple[str, ...] | None = Field(None, min_length=1)
    range_: tuple[float, float] | None = Field(None, alias="range", description="Valid range of a number.")

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def names(self) -> list[str]:
        if self.one_hot is None:
            return [self.name]
        return [f"{self.name}_{re.sub(r'[^a-z0-9]+', '_', v.lower()).strip('_')}" for v in self.one_hot]

    def encode(self, value: object) -> list[float]:
        if self.one_hot is None:
            return [float("nan") if value is None else float(value)]  # type: ignore[arg-type]
        return [1.0 if value == v else 0.0 for v in self.one_hot]


class EnrichmentSpec(_Model):
    """The entity's table joined to each reading and window (Kafka Streams' KStream–KTable join, by event time).

    The table is a compacted topic keyed by the entity (the processor's ``tables:``); a record's Kafka
    timestamp is when its version takes effect, a tombstone removes the entity from then on. A reading
    joins the version in effect at its event time; a window's attributes are those in effect at its last
    instant (``window_end - 1``), so a replay joins the same versions.
    """

    table: str = Field(description="The table topic (compacted, Avro value): what the Flink job reads by default; "
                                   "the embedded engine joins its processor's one `tables:` topic (this one among "
                                   "several).")
    schema_: str = Field(alias="schema", description="Avro subject of the table's values.")
    keep: dict[str, tuple[str | int | float | bool, ...]] = Field(
        default_factory=dict, description="Attribute → the values a reading's entity must have; other readings "
                                          "leave the stream, counted by attribute and value.")
    fill: dict[str, str] = Field(default_factory=dict, description="Input → the attribute whose value a null "
                                                                   "reading of it takes (a rated or last good value).")
    attributes: tuple[TableAttribute, ...] = Field((), description="Appended to the feature vector, in this order.")
    missing: Literal["dead_letter", "defaults"] = Field(
        "dead_letter", description="An entity with no version in effect: dead-lettered (reason `unknown_entity`), "
                                   "or joined with `defaults`.")
    defaults: dict[str, str | int | float | bool | None] = Field(default_factory=dict)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _defaults_cover(self) -> EnrichmentSpec:
        used = {*self.keep, *self.fill.values(), *(a.name for a in self.attributes)}
        if self.missing == "defaults" and (lacking := sorted(used - set(self.defaults))):
            raise ValueError(f"missing: defaults needs a default for every attribute used; none for {lacking}")
        return self

    def encode(self, entry: Mapping[str, object] | None) -> list[float]:
        """The ``attributes`` of one version of an entity (a table value), encoded in order as every engine appends
        them; ``None`` (no version in effect): the declared defaults, or zeros and NaN without them."""
        if entry is None and self.missing == "defaults":
            entry = self.defaults
        return [x for a in self.attributes for x in a.encode(None if entry is None else entry.get(a.name))]

    @property
    def used(self) -> tuple[str, ...]:
        """Every table attribute the join reads."""
        return tuple(dict.fromkeys([*self.keep, *self.fill.values(), *(a.name for a in self.attributes)]))


class OnlineSpec(_Model):
    ttl_s: int = Field(3600, ge=1, description="How long an entity's features live in the online store.")


class FeatureSet(_Model):
    """One declared feature set (``topologies/features/*.yaml``)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    version: int = Field(1, ge=1)
    owner: str = Field(min_length=1)
    description: str = ""
    entity: Entity
    source: SourceSpec
    output: OutputSpec
    window: WindowSpec
    sample_hz: float = Field(gt=0, description="Nominal reading rate, for the spectral features.")
    inputs: tuple[str, ...] = Field(min_length=1, description="The input fields (nullable doubles), in order.")
    aggregations: tuple[Aggregation, ...] = Field(min_length=1)
    ranges: dict[str, tuple[float, float]] = Field(default_factory=dict, description="Valid range of each input.")
    online: OnlineSpec = OnlineSpec()
    enrichment: EnrichmentSpec | None = Field(None, description="The entity table joined to readings and windows.")

    @model_validator(mode="after")
    def _consistent(self) -> FeatureSet:
        for agg in self.aggregations:
            unknown = [i for i in agg.inputs if i not in self.inputs]
            if unknown:
                raise ValueError(f"aggregation {agg.kind!r} uses undeclared inputs {unknown}")
        names = self.feature_names
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique: {names}")
        for name, (lo, hi) in self.ranges.items():
            if name not in self.inputs or lo > hi:
                raise ValueError(f"range of {name!r}: not a declared input, or low > high")
        if self.enrichment and (unknown := sorted(set(self.enrichment.fill) - set(self.inputs))):
            raise ValueError(f"enrichment fills {unknown}, which are not declared inputs")
        return self

    @cached_property
    def aggregate_names(self) -> tuple[str, ...]:
        """The features the window aggregations compute, in order."""
        return tuple(n for agg in self.aggregations for n in agg.names())

    @cached_property
    def attribute_names(self) -> tuple[str, ...]:
        """The encoded table attributes appended after them (none without ``enrichment``)."""
        return tuple(n for a in (self.enrichment.attributes if self.enrichment else ()) for n in a.names())

    @cached_property
    def feature_names(self) -> tuple[str, ...]:
        """The features of one window, in the order of the model's input vector: aggregates, then attributes."""
        return self.aggregate_names + self.attribute_names

    def vector(self, features: dict[str, float]) -> list[float]:
        """A model's input vector from a feature dict: the values in ``feature_names`` order."""
        return [float(features[name]) for name in self.feature_names]

    @property
    def columns(self) -> tuple[str, ...]:
        """Every field of an output row, in Avro order: key, window bounds, count, features."""
        return (self.entity.join_key, "window_start", "window_end", "count", *self.feature_names)

    def feature_ranges(self) -> dict[str, tuple[float, float]]:
        """The valid range of each feature, from the declared ranges of its inputs and aggregation."""
        out: dict[str, tuple[float, float]] = {}
        for agg in self.aggregations:
            if agg.kind == "stats":
                for i in agg.inputs:
                    lo, hi = self.ranges.get(i, (float("-inf"), float("inf")))
                    spread = hi - lo
                    bounds = {"mean": (lo, hi), "min": (lo, hi), "max": (lo, hi),
                              "std": (0.0, spread / 2), "ptp": (0.0, spread)}
                    out.update({f"{i}_{s}": bounds[s] for s in agg.stats})
            else:
                for n in agg.names():
                    out[n] = agg.range_ or (float("-inf"), float("inf"))
        for attr in self.enrichment.attributes if self.enrichment else ():
            bounds = (0.0, 1.0) if attr.one_hot else attr.range_ or (float("-inf"), float("inf"))
            out.update({n: bounds for n in attr.names()})
        return out


def load_feature_set(path: str | Path) -> FeatureSet:
    """Read and validate a feature-set file; errors name the file and the offending field.

    A relative path is the caller's to resolve (against the app folder: ``Topology.path``).
    """
    return _load(Path(path).resolve())


@cache
def _load(path: Path) -> FeatureSet:
    return load_model(path, FeatureSet, "feature set")
