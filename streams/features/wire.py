"""Confluent-framed Avro without confluent-kafka: for jobs that run outside the application env.

The PyFlink job runs in the Flink environment, which has fastavro but not confluent-kafka.
This codec speaks the same wire format as ``streams.avro`` (magic byte 0, 4-byte schema id,
Avro binary) and the same registry REST API (``GET /schemas/ids/<id>``,
``POST /subjects/<subject>`` to look an id up), with the standard library's HTTP client and
a deadline on every call.
"""

from __future__ import annotations

import copy
import io
import json
import struct
import urllib.error
import urllib.request
from typing import Any

import fastavro

from streams.errors import SchemaError

_HEADER = struct.Struct(">bI")
_CT = "application/vnd.schemaregistry.v1+json"


def plain(schema: Any) -> Any:
    """A copy of ``schema`` without logical types, so timestamps stay epoch-millisecond ints."""
    if isinstance(schema, dict):
        return {k: plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [plain(s) for s in schema]
    return schema


class RegistryREST:
    """The two registry calls a codec needs, over HTTP with a timeout."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": _CT, "Accept": _CT})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, TimeoutError) as exc:
            raise SchemaError(f"schema registry {self.url}{path}: {exc}") from exc

    def schema(self, schema_id: int) -> dict:
        return json.loads(self._call(f"/schemas/ids/{schema_id}")["schema"])

    def latest(self, subject: str) -> dict:
        """The newest schema registered under ``subject`` (what `tangram apply` registered from the app)."""
        return json.loads(self._call(f"/subjects/{subject}/versions/latest")["schema"])

    def lookup(self, subject: str, schema: dict) -> int:
        return int(self._call(f"/subjects/{subject}", {"schema": json.dumps(schema)})["id"])


class WireCodec:
    """Decode any registered writer schema into ``reader``; encode with ``reader``'s id under ``subject``."""

    def __init__(self, registry: RegistryREST, subject: str, reader: dict):
        self.registry = registry
        self.schema_id = registry.lookup(subject, reader)
        self.schema = fastavro.parse_schema(plain(copy.deepcopy(reader)))
        self._writers: dict[int, Any] = {self.schema_id: self.schema}
        self._header = _HEADER.pack(0, self.schema_id)

    def decode(self, data: bytes) -> dict:
        if data is None or len(data) < _HEADER.size or data[0] != 0:
            raise SchemaError("not Confluent-framed Avro (no magic byte 0 and schema id)")
        _, schema_id = _HEADER.unpack_from(data)
        writer = self._writers.get(schema_id)
        if writer is None:
            writer = self._writers[schema_id] = fastavro.parse_schema(plain(self.registry.schema(schema_id)))
        buf = io.BytesIO(data)
        buf.seek(_HEADER.size)
        try:
            if schema_id == self.schema_id:
                return fastavro.schemaless_reader(buf, self.schema, None)
            return fastavro.schemaless_reader(buf, writer, self.schema)
        except Exception as exc:  # fastavro raises EOFError, UnicodeDecodeError, SchemaResolutionError, ...
            raise SchemaError(f"cannot decode Avro with schema id {schema_id}: {type(exc).__name__}: {exc}") from exc

    def encode(self, record: dict) -> bytes:
        buf = io.BytesIO()
        buf.write(self._header)
        fastavro.schemaless_writer(buf, self.schema, record)
        return buf.getvalue()
