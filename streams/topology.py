"""Topologies: the declarative, executable description of an application.

A topology file (``topologies/*.yaml``) declares the topics (partitions, retention,
compaction, their Avro subject) and the processors with their inputs and outputs.
``tangram plan`` / ``tangram apply`` make the broker and the schema registry match it;
``tangram run NAME`` runs one processor of it. Later constraints (rates, SLAs,
timeouts) are added as fields of these same models.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streams import PROJECT_ROOT
from streams.errors import TopologyError

SCHEMA_DIR = PROJECT_ROOT / "schemas" / "avro"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Defaults(_Model):
    partitions: int = Field(3, ge=1)
    replication_factor: int = Field(1, ge=1)


class TopicSpec(_Model):
    """One Kafka topic. ``schema`` names an Avro subject with a file in ``schemas/avro/``."""

    partitions: int | None = Field(None, ge=1, description="Defaults to the topology's default.")
    replication_factor: int | None = Field(None, ge=1)
    retention_ms: int | None = Field(None, ge=-1, description="-1 keeps forever.")
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    format: Literal["avro", "json", "bytes"] = "avro"
    schema_: str | None = Field(None, alias="schema", description="Avro subject of the value.")
    description: str = ""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _avro_needs_schema(self) -> "TopicSpec":
        if self.format == "avro" and not self.schema_:
            raise ValueError("an avro topic needs `schema: <subject>`")
        if self.format != "avro" and self.schema_:
            raise ValueError(f"a {self.format} topic carries no Avro schema")
        return self

    def configs(self) -> dict[str, str]:
        """The topic-level Kafka configs this spec pins."""
        out = {"cleanup.policy": self.cleanup_policy}
        if self.retention_ms is not None:
            out["retention.ms"] = str(self.retention_ms)
        return out


class ProcessorSpec(_Model):
    """One stream processor: a class (``module:Class``) consuming ``inputs``, producing ``outputs``."""

    kind: str = Field(description="`package.module:Class` implementing streams.delivery.Processor.")
    inputs: list[str] = Field(min_length=1)
    outputs: list[str] = Field(default_factory=list)
    dlq: str | None = None
    group: str | None = Field(None, description="Consumer group; defaults to `<app>.<processor>`.")
    batch_size: int = Field(500, ge=1, le=100_000, description="Most records per micro-batch.")
    max_wait_ms: int = Field(100, ge=1, le=60_000, description="Longest wait to fill a micro-batch.")
    exactly_once: bool = Field(False, description="Kafka transactions instead of at-least-once.")
    params: dict[str, Any] = Field(default_factory=dict, description="Validated by the processor's own settings model.")

    def load_class(self) -> type:
        module_name, _, attr = self.kind.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise TopologyError(f"processor kind {self.kind!r} cannot be imported: {exc}") from exc


class Topology(_Model):
    app: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str = ""
    defaults: Defaults = Defaults()
    topics: dict[str, TopicSpec]
    processors: dict[str, ProcessorSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references_resolve(self) -> "Topology":
        for name, proc in self.processors.items():
            for topic in [*proc.inputs, *proc.outputs, *([proc.dlq] if proc.dlq else [])]:
                if topic not in self.topics:
                    raise ValueError(f"processor {name!r} uses topic {topic!r}, which is not declared under `topics`")
        for topic, spec in self.topics.items():
            if spec.schema_ and not (SCHEMA_DIR / f"{spec.schema_}.avsc").is_file():
                raise ValueError(f"topic {topic!r}: no schema file schemas/avro/{spec.schema_}.avsc")
        return self

    def partitions(self, topic: str) -> int:
        return self.topics[topic].partitions or self.defaults.partitions

    def replication(self, topic: str) -> int:
        return self.topics[topic].replication_factor or self.defaults.replication_factor

    def group(self, processor: str) -> str:
        return self.processors[processor].group or f"{self.app}.{processor}"

    def subjects(self) -> dict[str, str]:
        """Avro subject → schema text, for every topic that has one."""
        return {
            spec.schema_: (SCHEMA_DIR / f"{spec.schema_}.avsc").read_text()
            for spec in self.topics.values()
            if spec.schema_
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True, exclude_defaults=True), sort_keys=False)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; errors name the file and the offending field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"topology file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return Topology.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<top>'}: {err['msg']}" for err in exc.errors()
        )
        raise TopologyError(f"{path}: {problems}") from exc


def load_schema(subject: str) -> dict:
    """The parsed JSON of ``schemas/avro/<subject>.avsc``."""
    return json.loads((SCHEMA_DIR / f"{subject}.avsc").read_text())
