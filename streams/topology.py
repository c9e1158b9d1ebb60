"""Topologies: the declarative, executable description of an application.

An application is a folder (``topologies/predictive_maintenance/``) whose ``topology.yaml``
declares the topics (partitions, retention, compaction, their Avro subject), the processors
with their inputs and outputs and constraints, and where the app's other declarations are:
its Avro schemas (``schemas:``), its Triton model repository (``models:``), its feature sets
(in processor ``params``) and its optional plugin code (a simulator, custom stages), all as
paths relative to the app folder. The runtime imports no application: plugin code is
imported from the app folder by ``module:attr`` references (:meth:`Topology.load_object`).

``tangram plan`` / ``tangram apply`` make the broker, the schema registry and the model
server match it; ``tangram run APP NAME`` runs one processor of it.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from streams.errors import TopologyError
from streams.yamlfile import load_model

#: The file that makes a folder an application: ``tangram apply topologies/predictive_maintenance``.
TOPOLOGY_FILE = "topology.yaml"


class Kind:
    """The ``kind`` of the runtime's own processors, for the tools that find them by role (replay, trace, verify)."""

    INGEST = "streams.ingest:IngestValidator"
    FEATURES = "streams.features:WindowFeatures"
    INFERENCE = "inference_workers.worker:InferenceWorker"
    RULES = "streams.rules:RuleProcessor"
    DRIFT = "streams.monitor:DriftMonitor"
    CANARY = "streams.lifecycle.canary_job:CanaryJob"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Defaults(_Model):
    partitions: int = Field(3, ge=1)
    replication_factor: int = Field(1, ge=1)
    min_insync_replicas: int | None = Field(
        None, ge=1, description="Replicas that must have a record before the broker acknowledges it (producers use "
                                "acks=all): with replication_factor 3, 2 keeps writing through the loss of one broker "
                                "and loses nothing acknowledged. None: the broker's setting.")


class DataConstraints(_Model):
    """The seeds' data constraints of a topic: how records arrive and what happens at the peak."""

    protocol: Literal["kafka", "http", "mqtt"] = Field("kafka", description="How producers reach this topic.")
    baseline_rate: float | None = Field(None, gt=0, description="Expected events/s in normal operation.")
    peak_rate: float | None = Field(None, gt=0, description="Events/s at the declared peak.")
    peak_duration_s: float | None = Field(None, gt=0, description="How long the peak lasts.")
    drop_policy: Literal["never", "dlq"] = Field(
        "never", description="`never`: backpressure, nothing dropped; `dlq`: excess goes to the dead-letter topic.")

    @model_validator(mode="after")
    def _peak_above_baseline(self) -> "DataConstraints":
        if self.baseline_rate and self.peak_rate and self.peak_rate < self.baseline_rate:
            raise ValueError(f"peak_rate {self.peak_rate} is below baseline_rate {self.baseline_rate}")
        return self


class TopicSpec(_Model):
    """One Kafka topic. ``schema`` names an Avro subject with a file in ``schemas/avro/``."""

    partitions: int | None = Field(None, ge=1, description="Defaults to the topology's default.")
    replication_factor: int | None = Field(None, ge=1)
    min_insync_replicas: int | None = Field(None, ge=1, description="Defaults to the topology's default.")
    retention_ms: int | None = Field(None, ge=-1, description="-1 keeps forever.")
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    format: Literal["avro", "json", "bytes"] = "avro"
    schema_: str | None = Field(None, alias="schema", description="Avro subject of the value.")
    description: str = ""
    data: DataConstraints | None = Field(None, description="Rates and drop policy (data constraints).")

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


class CircuitBreaker(_Model):
    failures: int = Field(5, ge=1, description="Consecutive failures that open the breaker.")
    reset_s: float = Field(30.0, gt=0, description="How long it stays open before one trial call.")


class ExternalCall(_Model):
    """A call a processor makes outside Kafka, with its deadline and what happens when it fails."""

    service: Literal["triton", "redis", "registry", "http"]
    timeout_ms: int = Field(ge=1, le=300_000, description="Deadline of one call.")
    retries: int = Field(0, ge=0, le=100, description="Retries after the first try.")
    fallback: str | None = Field(None, description="What the processor does instead (e.g. `rules-only`), or none.")
    circuit_breaker: CircuitBreaker | None = None


class ComputeConstraints(_Model):
    device: Literal["cpu", "gpu", "any"] = Field("any", description="Where the work runs.")
    target_utilization: float = Field(0.7, gt=0, le=1, description="Planned busy share at the baseline rate.")
    max_rate_per_replica: float | None = Field(None, gt=0, description="Measured records/s one replica sustains.")


class StateConstraints(_Model):
    models_per_server: int | None = Field(None, ge=1, description="Model versions loaded side by side.")
    hot_reload: bool = Field(False, description="Config and models change without a restart.")
    ttl_s: int | None = Field(None, ge=1, description="Lifetime of state kept outside Kafka (online store).")


class EvolutionConstraints(_Model):
    routing: Literal["single", "canary", "shadow"] = "single"
    canary_share: float = Field(0.0, ge=0, le=1, description="Share of keys scored by the challenger.")
    rollback_rto_s: float | None = Field(None, gt=0, description="Promised time to serve the previous version again.")


class ProcessorSpec(_Model):
    """One stream processor: a class (``module:Class``) consuming ``inputs``, producing ``outputs``."""

    kind: str = Field(description="`package.module:Class` implementing streams.delivery.Processor.")
    inputs: list[str] = Field(min_length=1)
    outputs: list[str] = Field(default_factory=list)
    tables: list[str] = Field(default_factory=list, description="Compacted topics keyed by entity that this processor "
                                                                "reads whole into local state (every replica all of "
                                                                "it: a global table) and joins its inputs with.")
    dlq: str | None = None
    group: str | None = Field(None, description="Consumer group; defaults to `<app>.<processor>`.")
    batch_size: int = Field(500, ge=1, le=100_000, description="Most records per micro-batch.")
    max_wait_ms: int = Field(100, ge=1, le=60_000, description="Longest wait to fill a micro-batch.")
    linger_ms: int = Field(5, ge=0, le=60_000, description="Once a micro-batch's first record is there, how long "
                                                          "to wait for more (at most max_wait_ms).")
    commit_interval_ms: int = Field(100, ge=0, le=60_000, description="A delivery (acks, side effects, offset commit; "
                                                                     "exactly-once: a transaction) spans the batches "
                                                                     "of up to this long; it ends early when nothing "
                                                                     "more is at hand. 0: every batch on its own.")
    exactly_once: bool = Field(False, description="Kafka transactions instead of at-least-once.")
    params: dict[str, Any] = Field(default_factory=dict, description="Validated by the processor's own settings model.")
    replicas: int = Field(1, ge=1, description="Consumer-group members to run (docker compose --scale).")
    compute: ComputeConstraints = ComputeConstraints()
    state: StateConstraints = StateConstraints()
    calls: list[ExternalCall] = Field(default_factory=list, description="Every call outside Kafka, with its deadline.")
    evolution: EvolutionConstraints = EvolutionConstraints()


class Sla(_Model):
    """The end-to-end promise: from a record entering ``source`` to its consequence on ``sink``."""

    source: str
    sink: str
    p99_ms: float = Field(gt=0, description="99th percentile of source-to-sink latency.")
    recovery_s: float = Field(30.0, gt=0, description="Longest pause of the chain when a processor dies and is restarted.")


class GatewaySpec(_Model):
    """A stream producers reach over HTTP (``POST /v1/streams/<name>/events``) or MQTT.

    It shares the contract of an ingest processor: that processor's ``params`` (ranges, limits,
    timestamps), its output topic (Avro) and its DLQ; ``params`` here override some for the gateway.
    """

    processor: str = Field(description="The ingest processor whose rules, output topic and DLQ this stream shares.")
    mqtt_topics: list[str] = Field(default_factory=list, description="MQTT topic filters the MQTT adapter subscribes to.")
    params: dict[str, Any] = Field(default_factory=dict, description="Overrides of the processor's params (e.g. `rate_limits`).")


class ModelsSpec(_Model):
    """The app's Triton model repository and how its artifacts are made."""

    repository: str = Field("model_repository", description="Folder of the app's models (`<model>/config.pbtxt`, "
                                                             "`<model>/<version>/...`), relative to the app folder.")
    build: str | None = Field(None, description="`module:function` of the app's plugin code that writes the model "
                                                "artifacts into a repository folder (`tangram models build`).")


class SimulatorSpec(_Model):
    """The app's simulator: events with ground truth that the demo, verify and benchmarks drive it with."""

    kind: str = Field(description="`module:Class` of the app's plugin code, a streams.simulation.Simulator.")
    source: str = Field(description="The topic the simulated producers write to.")
    truth: str | None = Field(None, description="Topic the simulator writes its ground truth to, if any.")
    table: str | None = Field(None, description="The simulated entities' table (a compacted topic keyed by entity, "
                                                "e.g. the device register), if any: the versions in effect over a run.")
    params: dict[str, Any] = Field(default_factory=dict, description="Validated by the simulator's own settings.")


class UploadSpec(_Model):
    """Files producers upload over HTTP (``POST /v1/uploads/<name>``, ``multipart/form-data``) into an Avro topic.

    The topic's contract holds the file in a bytes field (``["null", "bytes"]``) with a ``<field>_ref``
    string beside it (a large file travels by reference, see ``payloads:``); the gateway fills the id,
    time, file name and content type, and the fields the declared request headers carry. Checking the
    file itself is the app's first stage's job, the same for files that arrive over Kafka.
    """

    topic: str = Field(description="The Avro topic the uploads go to.")
    file_field: str = Field("file", description="The contract's bytes field (and multipart part name) of the file.")
    id_field: str = Field(description="String field for the upload's id: the client's `X-Request-ID`, else a new one; "
                                      "also the Kafka key and the `event_id` header.")
    time_field: str = Field(description="Long field for the time the upload was received (epoch ms).")
    headers: dict[str, str] = Field(default_factory=dict, description="Required request header → string field "
                                                                      "(`X-Device-ID: device_id`).")
    filename_field: str | None = Field(None, description="String field for the uploaded file's name, if any.")
    content_type_field: str | None = Field(None, description="String field for the declared content type, if any.")
    max_bytes: int = Field(8 * 1024 * 1024, ge=1, description="Larger files are refused with 413.")


class PayloadsSpec(_Model):
    """Large values stored beside Kafka, by reference (:mod:`streams.payloads`): an uploaded image, a file.

    A contract holds such a value in a ``bytes`` field ``X`` (``["null", "bytes"]``) with a sibling string
    field ``X_ref``; a value over ``inline_max_bytes`` goes to the store and only its reference travels.
    """

    inline_max_bytes: int = Field(262_144, ge=1, le=900_000, description=(
        "Largest value carried inside a record; larger ones go to the store. At most 900 kB: a record stays "
        "under Kafka's default 1 MB `message.max.bytes` with room for the other fields and headers."))
    store: str = Field("payloads", description="The store's folder: relative to the stack's home "
                                               "(`TANGRAM_HOME`), or absolute (a volume every processor mounts).")


class Topology(_Model):
    app: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str = ""
    root: Path | None = Field(None, description="The app folder every relative path resolves against; "
                                                "default: the folder of the topology file.")
    schemas: str = Field("schemas", description="Folder of the app's Avro schemas (`<subject>.avsc`), "
                                                "relative to the app folder.")
    models: ModelsSpec = ModelsSpec()
    simulator: SimulatorSpec | None = None
    payloads: PayloadsSpec | None = Field(None, description="Values stored by reference when over a size limit.")
    defaults: Defaults = Defaults()
    sla: Sla | None = None
    topics: dict[str, TopicSpec]
    processors: dict[str, ProcessorSpec] = Field(default_factory=dict)
    gateways: dict[str, GatewaySpec] = Field(default_factory=dict, description="Stream name → HTTP/MQTT ingest stream.")
    uploads: dict[str, UploadSpec] = Field(default_factory=dict, description="Name → files uploaded over HTTP.")

    @model_validator(mode="after")
    def _references_resolve(self) -> "Topology":
        for name, proc in self.processors.items():
            for topic in [*proc.inputs, *proc.outputs, *proc.tables, *([proc.dlq] if proc.dlq else [])]:
                if topic not in self.topics:
                    raise ValueError(f"processor {name!r} uses topic {topic!r}, which is not declared under `topics`")
            for table in proc.tables:
                if "compact" not in self.topics[table].cleanup_policy or table in proc.inputs:
                    raise ValueError(f"processor {name!r}: table {table!r} must be a compacted topic (cleanup_policy: "
                                     "compact), read as a table and not also as an input")
        if self.sla:
            for end in (self.sla.source, self.sla.sink):
                if end not in self.topics:
                    raise ValueError(f"sla names topic {end!r}, which is not declared under `topics`")
        for stream, gateway in self.gateways.items():
            proc = self.processors.get(gateway.processor)
            if proc is None:
                raise ValueError(f"gateway {stream!r} names processor {gateway.processor!r}, which is not declared")
            if len(proc.outputs) != 1 or not proc.dlq or not self.topics[proc.outputs[0]].schema_:
                raise ValueError(f"gateway {stream!r}: processor {gateway.processor!r} needs one Avro output and a `dlq:`")
        for topic, spec in self.topics.items():
            if spec.schema_ and not self.schema_path(spec.schema_).is_file():
                raise ValueError(f"topic {topic!r}: no schema file {self.schema_path(spec.schema_)}")
            if (in_sync := self.min_insync(topic)) and in_sync > self.replication(topic):
                raise ValueError(f"topic {topic!r}: min_insync_replicas {in_sync} above its replication factor "
                                 f"{self.replication(topic)}: no write could ever be acknowledged")
        for name, upload in self.uploads.items():
            self._check_upload(name, upload)
        if shared := sorted(set(self.uploads) & set(self.gateways)):
            raise ValueError(f"{', '.join(shared)}: both a gateway stream and an upload; an API key names what it may "
                             "write by that name, so give them different names")
        if self.simulator:
            for topic in (self.simulator.source, self.simulator.truth, self.simulator.table):
                if topic and topic not in self.topics:
                    raise ValueError(f"simulator names topic {topic!r}, which is not declared under `topics`")
        return self

    def _check_upload(self, name: str, upload: UploadSpec) -> None:
        topic = self.topics.get(upload.topic)
        if topic is None or topic.schema_ is None:
            raise ValueError(f"upload {name!r}: topic {upload.topic!r} is not a declared Avro topic")
        fields = {f["name"]: f["type"] for f in json.loads(self.schema_path(topic.schema_).read_text())["fields"]}
        want = {upload.file_field: "bytes", f"{upload.file_field}_ref": "string", upload.id_field: "string",
                upload.time_field: "long", **{f: "string" for f in upload.headers.values()},
                **{f: "string" for f in (upload.filename_field, upload.content_type_field) if f}}
        for field, kind in want.items():
            declared = fields.get(field)
            types = declared if isinstance(declared, list) else [declared]
            if not any(t == kind or isinstance(t, dict) and t.get("type") == kind for t in types):
                raise ValueError(f"upload {name!r}: the contract of {upload.topic!r} needs a {kind} field {field!r}")

    # -- the app folder ----------------------------------------------------------------
    @property
    def folder(self) -> Path:
        """The app folder (``root``, else the working directory for a topology built in code)."""
        return self.root or Path.cwd()

    def path(self, relative: str | Path) -> Path:
        """``relative`` resolved against the app folder (an absolute path stays as it is)."""
        return (self.folder / relative).resolve()

    @property
    def schema_dir(self) -> Path:
        return self.path(self.schemas)

    @property
    def model_repository(self) -> Path:
        return self.path(self.models.repository)

    def schema_path(self, subject: str) -> Path:
        return self.schema_dir / f"{subject}.avsc"

    def schema(self, subject: str) -> dict:
        """The parsed JSON of the app's ``<subject>.avsc``."""
        try:
            return json.loads(self.schema_path(subject).read_text())
        except (OSError, ValueError) as exc:
            raise TopologyError(f"schema {subject!r} of app {self.app!r}: {exc}") from exc

    def load_object(self, reference: str) -> Any:
        """``module:attr`` imported with the app folder on the import path (the app's plugin code).

        The runtime's own classes (``streams.ingest:IngestValidator``) import the same way.
        """
        module_name, sep, attr = reference.partition(":")
        if not sep or not module_name or not attr:
            raise TopologyError(f"{reference!r} is not a `module:attr` reference")
        folder = str(self.folder)
        if folder not in sys.path:
            sys.path.append(folder)  # after the installed packages: an app never shadows the runtime
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise TopologyError(f"{reference!r} cannot be imported from app {self.app!r} ({folder}): {exc}") from exc

    def partitions(self, topic: str) -> int:
        return self.topics[topic].partitions or self.defaults.partitions

    def replication(self, topic: str) -> int:
        return self.topics[topic].replication_factor or self.defaults.replication_factor

    def min_insync(self, topic: str) -> int | None:
        return self.topics[topic].min_insync_replicas or self.defaults.min_insync_replicas

    def topic_configs(self, topic: str) -> dict[str, str]:
        """The topic-level Kafka configs the topology pins for ``topic`` (its own, then the defaults')."""
        configs = self.topics[topic].configs()
        if in_sync := self.min_insync(topic):
            configs["min.insync.replicas"] = str(in_sync)
        return configs

    def processors_of(self, kind: str) -> dict[str, ProcessorSpec]:
        """The processors of one kind (``Kind.RULES``, or an app's ``module:Class``), in declaration order."""
        return {name: spec for name, spec in self.processors.items() if spec.kind == kind}

    def group(self, processor: str) -> str:
        return self.processors[processor].group or f"{self.app}.{processor}"

    def subjects(self) -> dict[str, str]:
        """Avro subject → schema text, for every topic that has one."""
        return {spec.schema_: self.schema_path(spec.schema_).read_text()
                for spec in self.topics.values() if spec.schema_}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True, exclude_defaults=True), sort_keys=False)


def topology_file(path: str | Path) -> Path:
    """The topology file of ``path``: an app folder's ``topology.yaml``, or the file itself."""
    path = Path(path)
    return path / TOPOLOGY_FILE if path.is_dir() else path


def load_topology(path: str | Path) -> Topology:
    """Read and validate an app's topology (its folder or its file); errors name the file and the field.

    Relative paths in it resolve against ``root:`` when the file sets one (relative to the file),
    else against the folder the file is in.
    """
    path = topology_file(path).resolve()
    return load_model(path, Topology, "topology",
                      fill=lambda raw: {**raw, "root": str((path.parent / raw.get("root", ".")).resolve())})
