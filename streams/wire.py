"""The Confluent wire format, once: magic byte 0, a 4-byte big-endian schema id, then Avro binary.

This is what Kafka Connect, ksqlDB, Flink's ``avro-confluent`` format and confluent-kafka's own
serializers speak. Everything here needs only the standard library and fastavro, so the three
Python environments share it: the application's codecs (``streams.avro``, over confluent-kafka's
registry client), the Flink job's and the Feast bridge's (:class:`WireCodec`, over the registry's
REST API with the standard library's HTTP client).

:class:`Codec` is the one codec: it encodes with its subject's schema and id, and decodes any
writer id into that schema (Avro schema resolution), fetching an unknown writer schema once.
Timestamps stay epoch milliseconds (logical types are read as the plain ``long`` they are on
the wire), which keeps the hot path free of datetimes.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import struct
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import fastavro

from streams.errors import SchemaError

MAGIC_BYTE = 0
#: The 5 bytes before every value: magic byte and schema id.
HEADER = struct.Struct(">bI")


class WireFormatError(SchemaError):
    """A value is not a Confluent-framed Avro record this codec can read."""


def plain(schema: Any) -> Any:
    """A copy of ``schema`` without logical types, so timestamps decode as ints."""
    if isinstance(schema, dict):
        return {k: plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [plain(s) for s in schema]
    return schema


def parse(schema: dict) -> Any:
    """``schema`` parsed for fastavro, logical types left out."""
    return fastavro.parse_schema(plain(copy.deepcopy(schema)))


def frame(schema_id: int) -> bytes:
    return HEADER.pack(MAGIC_BYTE, schema_id)


def schema_id_of(data: bytes | None) -> int:
    """The schema id of a framed value; WireFormatError for a value too short or without the magic byte."""
    if data is None or len(data) < HEADER.size:
        raise WireFormatError(f"value of {0 if data is None else len(data)} bytes is shorter than the 5-byte header")
    magic, schema_id = HEADER.unpack_from(data)
    if magic != MAGIC_BYTE:
        raise WireFormatError(f"magic byte {magic} is not {MAGIC_BYTE}: not Confluent-framed Avro")
    return schema_id


class Codec:
    """Encode with one subject's schema and id; decode any writer id into that schema.

    ``writer(schema_id)`` returns the parsed writer schema of an id this codec has not seen (raising
    WireFormatError when the registry does not know it); each is fetched once.
    """

    def __init__(self, subject: str, schema: dict, schema_id: int, writer: Callable[[int], Any]):
        self.subject = subject
        self.schema_json = schema
        self.schema_id = schema_id
        self.schema = parse(schema)
        self._writer = writer
        self._writers: dict[int, Any] = {}
        self._header = frame(schema_id)

    @property
    def header(self) -> bytes:
        """The 5 bytes that start every value this codec writes: magic byte and schema id."""
        return self._header

    def encode(self, record: dict) -> bytes:
        buf = io.BytesIO()
        buf.write(self._header)
        fastavro.schemaless_writer(buf, self.schema, record)
        return buf.getvalue()

    def decode(self, data: bytes | None) -> dict:
        schema_id = schema_id_of(data)
        buf = io.BytesIO(data)
        buf.seek(HEADER.size)
        writer = None
        if schema_id != self.schema_id:
            writer = self._writers.get(schema_id)
            if writer is None:  # outside the try: a registry that does not answer is not the record's fault
                writer = self._writers[schema_id] = self._writer(schema_id)
        try:
            if writer is None:
                record = fastavro.schemaless_reader(buf, self.schema, None)
            else:
                record = fastavro.schemaless_reader(buf, writer, self.schema)
        except WireFormatError:
            raise
        except Exception as exc:  # fastavro raises EOFError, UnicodeDecodeError, SchemaResolutionError, ...
            raise WireFormatError(f"cannot decode Avro with schema id {schema_id}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):  # type: ignore[arg-type]  # schema_id_of checked it is bytes
            raise WireFormatError(f"{len(data) - buf.tell()} trailing bytes after the Avro record")
        return record


_CT = "application/vnd.schemaregistry.v1+json"


class RegistryREST:
    """The registry calls a codec needs, over the Confluent REST API with the standard library, with a deadline."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        parts = urlsplit(url.rstrip("/"))  # a user:password@ in the URL is sent as basic auth, never shown
        self.url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.timeout_s = timeout_s
        self._auth = {} if parts.username is None else {"Authorization": "Basic " + base64.b64encode(
            f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()}

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": _CT, "Accept": _CT, **self._auth})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - the configured registry
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise WireFormatError(f"schema registry {self.url}{path}: not found") from exc
            raise SchemaError(f"schema registry {self.url}{path}: {exc}") from exc
        except (urllib.error.URLError, TimeoutError) as exc:
            raise SchemaError(f"schema registry {self.url}{path}: {exc}") from exc

    def schema(self, schema_id: int) -> dict:
        return json.loads(self._call(f"/schemas/ids/{schema_id}")["schema"])

    def latest(self, subject: str) -> dict:
        """The newest schema registered under ``subject`` (what `tangram apply` registered from the app)."""
        return json.loads(self._call(f"/subjects/{subject}/versions/latest")["schema"])

    def lookup(self, subject: str, schema: dict) -> int:
        return int(self._call(f"/subjects/{subject}", {"schema": json.dumps(schema)})["id"])


class WireCodec(Codec):
    """The codec of ``subject`` over the registry's REST API (the Flink job's and the Feast bridge's)."""

    def __init__(self, registry: RegistryREST, subject: str, schema: dict | None = None):
        schema = schema if schema is not None else registry.latest(subject)
        super().__init__(subject, schema, registry.lookup(subject, schema), lambda i: parse(registry.schema(i)))
