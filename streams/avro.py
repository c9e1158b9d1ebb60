"""The application's Avro codecs: the wire format of :mod:`streams.wire` over confluent-kafka's registry client.

``codec(registry_url, subject, schema)`` is the one codec of a subject per process, bound to the id
`tangram apply` registered; ``topic_codec(topology, registry_url, topic)`` is that of an app's topic.
An :class:`AvroCodec` is a :class:`streams.wire.Codec` (encode with the subject's schema, decode any
writer id into it) plus the batch codec of the hot paths (:mod:`streams.columnar`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from streams.columnar import BatchCodec
from streams.errors import SchemaError, TopologyError
from streams.resilience import DEFAULT_CALLS, Guard
from streams.wire import Codec, WireFormatError, parse

if TYPE_CHECKING:
    from streams.topology import Topology

#: Below this many records a batch is decoded record by record (numpy's fixed cost per call outweighs
#: fastavro's per-record cost; measured crossover 20–60 records on this machine).
SMALL_BATCH = 32
#: Below this many records a batch is encoded row by row in Python (``BatchCodec._encode_rows``): 3.1–3.5 µs
#: a reading and 7.4–7.7 µs a window of 30 doubles against the column path's 3.5 / 5.9 µs at 128 rows,
#: 5.7 / 8.2 µs at 64 (fastavro record by record: 10.5 / 17.3 µs at any size).
SMALL_ENCODE = 100


class RegistryFailure(SchemaError):
    """The registry did not answer, or failed (5xx): the service's fault, not the schema's (retried, then backpressure)."""


class RegistryClient:
    """A thin cache over confluent-kafka's ``SchemaRegistryClient``: register, look up, writer schemas by id.

    Every call goes through ``guard`` (:mod:`streams.resilience`: deadline, retries, breaker), so an
    unreachable registry raises :class:`~streams.errors.ServiceUnavailableError` (backpressure), never a
    schema error: a record is never dead-lettered because the registry was down.
    """

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url
        self.client = SchemaRegistryClient({"url": url, "timeout": timeout_s})
        self._by_id: dict[int, Any] = {}
        self.guard: Guard = Guard("registry-client", DEFAULT_CALLS["registry"], (RegistryFailure,))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        def once() -> Any:
            try:
                return fn(*args)
            except SchemaRegistryError as exc:
                if exc.http_status_code >= 500 or exc.http_status_code < 0:
                    raise RegistryFailure(f"schema registry {self.url}: {exc}") from exc
                raise
            except Exception as exc:  # noqa: BLE001 - the HTTP client's connect/read errors and timeouts
                raise RegistryFailure(f"schema registry {self.url}: {type(exc).__name__}: {exc}") from exc
        return self.guard.call(once)

    def register(self, subject: str, schema_text: str) -> int:
        try:
            return self._call(self.client.register_schema, subject, Schema(schema_text, "AVRO"))
        except SchemaRegistryError as exc:
            raise SchemaError(f"registry refused {subject}: {exc}") from exc

    def lookup(self, subject: str, schema_text: str) -> int:
        """The id of ``schema_text`` under ``subject``; fails if `tangram apply` has not registered it."""
        try:
            return self._call(self.client.lookup_schema, subject, Schema(schema_text, "AVRO")).schema_id
        except SchemaRegistryError as exc:
            raise SchemaError(
                f"subject {subject!r} does not hold this schema in the registry at {self.url} ({exc}); "
                "run `tangram apply <app>` first"
            ) from exc

    def latest(self, subject: str) -> dict:
        """The newest schema registered under ``subject``."""
        try:
            return json.loads(self._call(self.client.get_latest_version, subject).schema.schema_str)
        except SchemaRegistryError as exc:
            raise SchemaError(f"subject {subject!r} is not in the registry at {self.url} ({exc}); "
                              "run `tangram apply <app>` first") from exc

    def parsed(self, schema_id: int) -> Any:
        """The writer schema with this id, parsed for fastavro (cached)."""
        if schema_id not in self._by_id:
            try:
                text = self._call(self.client.get_schema, schema_id).schema_str
            except SchemaRegistryError as exc:
                raise WireFormatError(f"unknown schema id {schema_id}: {exc}") from exc
            self._by_id[schema_id] = parse(json.loads(text))
        return self._by_id[schema_id]


class AvroCodec(Codec):
    """Encode and decode the values of one subject (see :class:`streams.wire.Codec`), with its batch codec."""

    def __init__(self, registry: RegistryClient, subject: str, schema: dict, *, register: bool = False):
        text = json.dumps(schema)
        schema_id = registry.register(subject, text) if register else registry.lookup(subject, text)
        super().__init__(subject, schema, schema_id, registry.parsed)
        self.registry = registry

    @cached_property
    def batch(self) -> BatchCodec | None:
        """Whole-batch encoding and decoding of this schema (``None``: not a flat record; use ``encode``/``decode``)."""
        try:
            return BatchCodec(self.schema_json, self.header, small_batch=SMALL_BATCH, small_encode=SMALL_ENCODE,
                              record_writer=self.encode)
        except ValueError:  # a field type the batch codec does not cover
            return None


@lru_cache(maxsize=None)
def _cached_codec(url: str, subject: str, schema_json: str, register: bool) -> AvroCodec:
    return AvroCodec(_registry(url), subject, json.loads(schema_json), register=register)


@lru_cache(maxsize=None)
def _registry(url: str) -> RegistryClient:
    return RegistryClient(url)


def codec(registry_url: str, subject: str, schema: dict | None = None, *, register: bool = False) -> AvroCodec:
    """One codec per (registry, subject, schema) per process; without ``schema``, the subject's newest one."""
    if schema is None:
        schema = _registry(registry_url).latest(subject)
    return _cached_codec(registry_url, subject, json.dumps(schema), register)


def registry_client(url: str) -> RegistryClient:
    """The process's client of the registry at ``url`` (one per URL; its guard is the processor's registry calls)."""
    return _registry(url)


def topic_codec(topology: Topology, registry_url: str, topic: str) -> AvroCodec:
    """The codec of an Avro topic of ``topology``: its subject, with the schema of the app's file."""
    subject = topology.topics[topic].schema_
    if not subject:
        raise TopologyError(f"topic {topic!r} of app {topology.app!r} is not an Avro topic")
    return codec(registry_url, subject, topology.schema(subject))


__all__ = ["AvroCodec", "RegistryClient", "RegistryFailure", "WireFormatError", "codec", "registry_client", "topic_codec"]
