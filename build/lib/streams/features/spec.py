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
        return self

    @cached_property
    def feature_names(self) -> tuple[str, ...]:
        """The features of one window, in the order of the model's input vector."""
        return tuple(n for agg in self.aggregations for n in agg.names())

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
        return out


def load_feature_set(path: str | Path) -> FeatureSet:
    """Read and validate a feature-set file; errors name the file and the offending field.

    A relative path is the caller's to resolve (against the app folder: ``Topology.path``).
    """
    return _load(Path(path).resolve())


@cache
def _load(path: Path) -> FeatureSet:
    return load_model(path, FeatureSet, "feature set")
