"""Avro values in the Confluent wire format: magic byte 0, 4-byte big-endian schema id, Avro binary.

This is what Kafka Connect, ksqlDB, Flink's ``avro-confluent`` format and
confluent-kafka's own serializers speak. Encoding and decoding use fastavro's
schemaless reader/writer; writer schemas are fetched from the registry by id once
and cached. Timestamps stay epoch milliseconds (the logical type is read as the
plain ``long`` it is on the wire), which keeps the hot path free of datetimes.
"""

from __future__ import annotations

import copy
import io
import json
import struct
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import fastavro
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from streams.columnar import BatchCodec
from streams.errors import SchemaError, TopologyError

if TYPE_CHECKING:
    from streams.topology import Topology

MAGIC_BYTE = 0
#: Below this many records a batch is encoded and decoded record by record (numpy's fixed cost per
#: call outweighs fastavro's per-record cost; measured crossover 20–60 records on this machine).
SMALL_BATCH = 32
_HEADER = struct.Struct(">bI")


class WireFormatError(SchemaError):
    """A value is not a Confluent-framed Avro record this codec can read."""


def _plain(schema: Any) -> Any:
    """A copy of ``schema`` without logical types, so timestamps decode as ints."""
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_plain(s) for s in schema]
    return schema


class Registry:
    """A thin cache over confluent-kafka's ``SchemaRegistryClient``."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url
        self.client = SchemaRegistryClient({"url": url, "timeout": timeout_s})
        self._by_id: dict[int, Any] = {}

    def register(self, subject: str, schema_text: str) -> int:
        try:
            return self.client.register_schema(subject, Schema(schema_text, "AVRO"))
        except SchemaRegistryError as exc:
            raise SchemaError(f"registry refused {subject}: {exc}") from exc

    def lookup(self, subject: str, schema_text: str) -> int:
        """The id of ``schema_text`` under ``subject``; fails if `tangram apply` has not registered it."""
        try:
            return self.client.lookup_schema(subject, Schema(schema_text, "AVRO")).schema_id
        except SchemaRegistryError as exc:
            raise SchemaError(
                f"subject {subject!r} does not hold this schema in the registry at {self.url} ({exc}); "
                "run `tangram apply <topology>` first"
            ) from exc

    def latest(self, subject: str) -> dict:
        """The newest schema registered under ``subject``."""
        try:
            return json.loads(self.client.get_latest_version(subject).schema.schema_str)
        except SchemaRegistryError as exc:
            raise SchemaError(f"subject {subject!r} is not in the registry at {self.url} ({exc}); "
                              "run `tangram apply <app>` first") from exc

    def parsed(self, schema_id: int) -> Any:
        """The writer schema with this id, parsed for fastavro (cached)."""
        if schema_id not in self._by_id:
            try:
                text = self.client.get_schema(schema_id).schema_str
            except SchemaRegistryError as exc:
                raise WireFormatError(f"unknown schema id {schema_id}: {exc}") from exc
            self._by_id[schema_id] = fastavro.parse_schema(_plain(json.loads(text)))
        return self._by_id[schema_id]


class AvroCodec:
    """Encode and decode the values of one subject.

    ``encode`` writes with the subject's schema and id. ``decode`` reads any
    writer id the registry knows into this subject's (reader) schema, following
    Avro schema resolution.
    """

    def __init__(self, registry: Registry, subject: str, schema: dict, *, register: bool = False):
        text = json.dumps(schema)
        self.subject = subject
        self.registry = registry
        self.schema_id = registry.register(subject, text) if register else registry.lookup(subject, text)
        self.schema_json = schema
        self.schema = fastavro.parse_schema(_plain(copy.deepcopy(schema)))
        self._header = _HEADER.pack(MAGIC_BYTE, self.schema_id)

    @property
    def header(self) -> bytes:
        """The 5 bytes that start every value this codec writes: magic byte and schema id."""
        return self._header

    @cached_property
    def batch(self) -> BatchCodec | None:
        """Whole-batch encoding and decoding of this schema (``None``: not a flat record; use ``encode``/``decode``)."""
        try:
            return BatchCodec(self.schema_json, self._header, small_batch=SMALL_BATCH, record_writer=self.encode)
        except ValueError:  # a field type the batch codec does not cover
            return None

    def encode(self, record: dict) -> bytes:
        buf = io.BytesIO()
        buf.write(self._header)
        fastavro.schemaless_writer(buf, self.schema, record)
        return buf.getvalue()

    def decode(self, data: bytes | None) -> dict:
        if data is None or len(data) < _HEADER.size:
            raise WireFormatError(f"value of {0 if data is None else len(data)} bytes is shorter than the 5-byte header")
        magic, schema_id = _HEADER.unpack_from(data)
        if magic != MAGIC_BYTE:
            raise WireFormatError(f"magic byte {magic} is not {MAGIC_BYTE}: not Confluent-framed Avro")
        buf = io.BytesIO(data)
        buf.seek(_HEADER.size)
        try:
            if schema_id == self.schema_id:
                record = fastavro.schemaless_reader(buf, self.schema, None)
            else:
                record = fastavro.schemaless_reader(buf, self.registry.parsed(schema_id), self.schema)
        except WireFormatError:
            raise
        except Exception as exc:  # fastavro raises EOFError, UnicodeDecodeError, SchemaResolutionError, ...
            raise WireFormatError(f"cannot decode Avro with schema id {schema_id}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise WireFormatError(f"{len(data) - buf.tell()} trailing bytes after the Avro record")
        return record


@lru_cache(maxsize=None)
def _cached_codec(url: str, subject: str, schema_json: str, register: bool) -> AvroCodec:
    return AvroCodec(_registry(url), subject, json.loads(schema_json), register=register)


@lru_cache(maxsize=None)
def _registry(url: str) -> Registry:
    return Registry(url)


def codec(registry_url: str, subject: str, schema: dict | None = None, *, register: bool = False) -> AvroCodec:
    """One codec per (registry, subject, schema) per process; without ``schema``, the subject's newest one."""
    if schema is None:
        schema = _registry(registry_url).latest(subject)
    return _cached_codec(registry_url, subject, json.dumps(schema), register)


def topic_codec(topology: Topology, registry_url: str, topic: str) -> AvroCodec:
    """The codec of an Avro topic of ``topology``: its subject, with the schema of the app's file."""
    subject = topology.topics[topic].schema_
    if not subject:
        raise TopologyError(f"topic {topic!r} of app {topology.app!r} is not an Avro topic")
    return codec(registry_url, subject, topology.schema(subject))
