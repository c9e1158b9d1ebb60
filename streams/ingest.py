"""Ingest (seed node 1): raw readings → validated Avro on the ingest topic, the rest to the DLQ.

``Validator`` is the one validation path every ingest adapter shares (the Kafka
processor below, the HTTP and MQTT gateways in ``streams.gateway``): size,
encoding, JSON or Confluent-framed Avro, the Avro contract (required fields,
types, no unknown fields), value ranges declared in the topology, timestamp
sanity (future, too old, out of order per device), per-client and per-device
rate limits (``RateLimiter``: token buckets) and dedup by ``event_id`` (``IngestMemory``). It does no I/O, so it is
tested without Kafka; every rejection is counted in
``tangram_ingest_rejected_total{stream,reason}``.
``IngestValidator`` is the Kafka adapter: raw JSON (or Avro) topic → Avro topic.
"""

from __future__ import annotations

import hashlib
import io
import math
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Literal

import fastavro
import numpy as np
import orjson
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastavro._read_common import SchemaResolutionError
from fastavro.validation import ValidationError as AvroValidationError
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from streams.avro import AvroCodec
from streams.context import BuildContext
from streams.delivery import (
    H_EVENT_ID, H_INGEST_MS, H_TRACE_ID, H_TRACEPARENT, Output, Processor, Record, dead_letter, traceparent,
)
from streams.errors import TopologyError
from streams.registry import compatibility
from streams.wire import HEADER, MAGIC_BYTE, WireFormatError, plain

DUPLICATES = Counter("tangram_ingest_duplicates_total", "Readings dropped as duplicates of an event_id already accepted.", ["processor"])
REJECTED = Counter("tangram_ingest_rejected_total", "Readings refused by the validation path, by reason.", ["stream", "reason"])
FIELD_REJECTED = Counter("tangram_ingest_field_rejected_total",
                         "Readings refused because of one field (type, range, time), per field and reason.",
                         ["stream", "field", "reason"])
FIELD_MISSING = Counter("tangram_ingest_field_missing_total",
                        "Accepted readings in which a field arrived null (a dropped sensor), per field.", ["stream", "field"])

#: Header an upstream producer may set to be rate-limited as one client on the Kafka path.
H_CLIENT_ID = "client_id"


class Rejected(Exception):
    """A reading that breaks the contract. ``reason`` is a short stable code for the DLQ header.

    ``field`` names the offending field (``temperature``, ``nested.x``) when there is one;
    ``retry_after_s`` is set for ``rate_limited``: when the caller may try again.
    """

    def __init__(self, reason: str, message: str, *, field: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.field = field
        self.retry_after_s = retry_after_s


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TokenBucketSettings(_Frozen):
    """A sustained rate and the burst allowed above it."""

    rate_per_s: float = Field(gt=0, description="Tokens added per second: the sustained records/s allowed.")
    burst: int = Field(ge=1, description="Bucket size: records accepted at once after a quiet period.")


class RateLimitSettings(_Frozen):
    """Token buckets per client (HTTP client, MQTT topic, Kafka `client_id` header) and per device."""

    per_client: TokenBucketSettings | None = Field(None, description="Limit of each client; none by default.")
    per_device: TokenBucketSettings | None = Field(None, description="Limit of each device (the entity field); none by default.")
    max_keys: int = Field(100_000, ge=1, description="Most buckets kept; the least recently used are forgotten (refilled).")


class IngestSettings(_Frozen):
    max_record_bytes: int = Field(4096, ge=64, description="Larger readings are rejected as oversize.")
    max_future_skew_ms: int = Field(30_000, ge=0, description="How far ahead of the broker's clock an event time may be.")
    max_age_ms: int = Field(3_600_000, ge=0, description="How far behind the broker's clock an event time may be.")
    max_out_of_order_ms: int | None = Field(
        None, ge=0, description="How far behind the device's latest accepted event time a reading may be; none = any.")
    dedup_window: int = Field(100_000, ge=0, description="How many recent event_ids are remembered for dedup.")
    ranges: dict[str, tuple[float, float]] = Field(default_factory=dict, description="field → [min, max] inclusive.")
    entity_field: str = Field(description="The field that names the entity; it must equal the Kafka key.")
    time_field: str = Field(description="The event-time field (epoch ms).")
    id_field: str = Field("event_id", description="The field holding each event's unique id (dedup, the `event_id` "
                                                  "header of every record derived from it).")
    rate_limits: RateLimitSettings = Field(default_factory=RateLimitSettings, description="Token-bucket limits.")
    reference_time: Literal["wall", "record"] = Field(
        "wall", description="Timestamps are judged against the wall clock, or (replays, backtests) against the time "
                            "the record was produced to Kafka.")


class TokenBuckets:
    """One token bucket per key, refilled lazily from a clock the caller passes (seconds).

    ``take`` is all-or-nothing: either every requested token is available and taken, or none
    is and the answer says how long until they would be.
    """

    def __init__(self, settings: TokenBucketSettings, max_keys: int):
        self.rate = settings.rate_per_s
        self.burst = float(settings.burst)
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # key → [tokens, last refill]

    def shortfall(self, key: str, n: int, now_s: float) -> float:
        """Seconds until ``n`` tokens are available for ``key`` (0 if they are now); takes nothing."""
        tokens = self._refill(key, now_s)[0]
        if n <= tokens:
            return 0.0
        if n > self.burst:
            return math.inf
        return (n - tokens) / self.rate

    def take(self, key: str, n: int) -> None:
        """Take ``n`` tokens (after ``shortfall`` said they are there)."""
        self._buckets[key][0] -= n

    def _refill(self, key: str, now_s: float) -> list[float]:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [self.burst, now_s]
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(0.0, now_s - bucket[1])  # clocks from several partitions need not be monotonic
            bucket[0] = min(self.burst, bucket[0] + elapsed * self.rate)
            bucket[1] = max(bucket[1], now_s)
        return bucket


class RateLimiter:
    """The declared rate limits of one ingest stage: a token bucket per client and per device (either optional)."""

    def __init__(self, limits: RateLimitSettings):
        self.limits = limits
        self._per_client = TokenBuckets(limits.per_client, limits.max_keys) if limits.per_client else None
        self._per_device = TokenBuckets(limits.per_device, limits.max_keys) if limits.per_device else None

    @property
    def declared(self) -> bool:
        """Whether any limit is declared (none: nothing is ever throttled)."""
        return self._per_client is not None or self._per_device is not None

    def throttle(self, devices: Mapping[str, int], client: str | None, now_s: float) -> None:
        """Take tokens for ``devices`` (device → readings) and ``client``, all or none; raise ``rate_limited``."""
        total = sum(devices.values())
        waits: list[tuple[float, str]] = []
        if self._per_client is not None and client is not None:
            waits.append((self._per_client.shortfall(client, total, now_s), f"client {client!r}"))
        if self._per_device is not None:
            waits += [(self._per_device.shortfall(d, n, now_s), f"device {d!r}") for d, n in devices.items()]
        if waits:
            wait, who = max(waits)
            if wait > 0:
                limits = self.limits
                bucket = limits.per_client if who.startswith("client") else limits.per_device
                hint = ("more than the burst at once: send smaller batches" if math.isinf(wait)
                        else f"retry in {wait:.2f}s")
                raise Rejected("rate_limited", f"{who} is over its limit of {bucket.rate_per_s:g}/s "
                                               f"(burst {bucket.burst}); {hint}",
                               retry_after_s=wait if not math.isinf(wait) else None)
        if self._per_client is not None and client is not None:
            self._per_client.take(client, total)
        if self._per_device is not None:
            for d, n in devices.items():
                self._per_device.take(d, n)


@dataclass
class BatchVerdict:
    """What ``Validator.admit_batch`` decided for a batch of readings."""

    accepted: list[tuple[int, dict]] = field(default_factory=list)  # (index in the batch, record)
    rejected: list[tuple[int, Rejected]] = field(default_factory=list)
    duplicates: int = 0
    throttled: Rejected | None = None  # the whole batch was refused by a rate limit


_INT32, _INT64 = 2**31, 2**63
_PRIMITIVES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and -_INT32 <= v < _INT32,
    "long": lambda v: isinstance(v, int) and not isinstance(v, bool) and -_INT64 <= v < _INT64,
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "double": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, bytes),
}


def _type_check(avro_type: Any) -> Callable[[Any], bool] | None:
    """A fast predicate for a primitive type or a union of primitives; None for anything richer.

    ``fastavro.validate`` builds an error object for every union branch it rejects, which makes
    it the slowest step of the hot path (≈38 µs a reading); flat contracts are checked with these
    predicates instead, and the rest with fastavro.
    """
    if isinstance(avro_type, str):
        return _PRIMITIVES.get(avro_type)
    if isinstance(avro_type, dict) and isinstance(avro_type.get("type"), str) and avro_type["type"] in _PRIMITIVES:
        return _PRIMITIVES[avro_type["type"]]  # a logical type over a primitive
    if isinstance(avro_type, list):
        branches = [_type_check(b) for b in avro_type]
        if not all(branches):
            return None
        if len(avro_type) == 2 and "null" in avro_type:  # the usual optional field: ["null", T]
            other = branches[1] if avro_type[0] == "null" else branches[0]
            return lambda v: v is None or other(v)
        return lambda v: any(check(v) for check in branches)
    return None


_PYTHON_TYPES: dict[str, frozenset[type]] = {
    "null": frozenset({type(None)}), "boolean": frozenset({bool}), "int": frozenset({int}), "long": frozenset({int}),
    "float": frozenset({int, float}), "double": frozenset({int, float}), "string": frozenset({str}),
}


def _base_type(avro_type: Any) -> Any:
    """The primitive under a logical type or an optional (``["null", T]``) field."""
    if isinstance(avro_type, list) and len(avro_type) == 2 and "null" in avro_type:
        avro_type = avro_type[1 - avro_type.index("null")]
    return avro_type["type"] if isinstance(avro_type, dict) else avro_type


def _allowed_types(avro_type: Any) -> frozenset[type] | None:
    """The exact Python types (as orjson returns them) a JSON value of ``avro_type`` may have; None if not flat."""
    if isinstance(avro_type, list):
        parts = [_allowed_types(b) for b in avro_type]
        return frozenset().union(*parts) if all(parts) and len(avro_type) == 2 and "null" in avro_type else None
    base = _base_type(avro_type)
    return _PYTHON_TYPES.get(base) if isinstance(base, str) else None


def _describe(avro_type: Any) -> str:
    if isinstance(avro_type, list):
        return " or ".join(_describe(b) for b in avro_type)
    return avro_type["type"] if isinstance(avro_type, dict) else str(avro_type)


class IngestMemory:
    """What the ingest stage remembers of the readings it accepted, each bounded (the oldest goes first): their
    event ids, the last ``dedup_window`` of them (0: none, no dedup); and each entity's latest event time, for
    the ``max_keys`` entities seen last, when the out-of-order check is on (``track_time``)."""

    def __init__(self, dedup_window: int, max_keys: int, track_time: bool):
        self.dedup_window, self.max_keys, self.track_time = dedup_window, max_keys, track_time
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.latest: OrderedDict[str, int] = OrderedDict()  # entity → its latest event time

    def seen(self, event_id: str) -> bool:
        """Whether ``event_id`` was accepted within the dedup window (remembers nothing)."""
        return self.dedup_window > 0 and event_id in self.ids

    def seen_any(self, ids: list[str]) -> bool:
        """Whether any of ``ids`` repeats among them or was accepted within the dedup window."""
        return self.dedup_window > 0 and (len(set(ids)) != len(ids) or not self.ids.keys().isdisjoint(ids))

    def remember(self, event_id: str, entity: str | None, ts: int | None) -> None:
        """An accepted reading: its id for dedup, its time for the out-of-order check."""
        self._remember_id(event_id)
        self._remember_time(entity, ts)

    def remember_all(self, ids: list[str], entities: list | None, times: list | None) -> None:
        """Accepted readings, in order (as :meth:`remember` one by one)."""
        if self.dedup_window > 0:
            self.ids.update(dict.fromkeys(ids))
            while len(self.ids) > self.dedup_window:
                self.ids.popitem(last=False)
        if self.track_time and entities is not None and times is not None:
            for entity, t in zip(entities, times):
                self._remember_time(entity, t)

    def forget(self, ids: Iterable[str]) -> None:
        """Undo :meth:`remember`'s dedup for readings whose delivery failed (the producer's retry is no duplicate)."""
        for event_id in ids:
            self.ids.pop(event_id, None)

    def _remember_id(self, event_id: str) -> None:
        if self.dedup_window == 0:
            return
        self.ids[event_id] = None
        if len(self.ids) > self.dedup_window:
            self.ids.popitem(last=False)

    def _remember_time(self, entity: str | None, ts: int | None) -> None:
        if entity is not None and ts is not None and self.track_time:
            if ts > self.latest.get(entity, ts - 1):
                self.latest[entity] = ts
            self.latest.move_to_end(entity)
            if len(self.latest) > self.max_keys:
                self.latest.popitem(last=False)


class Validator:
    """Turns raw bytes into a record that satisfies the contract, or raises ``Rejected``.

    ``validate*`` check one reading against the contract (pure but for the out-of-order check,
    which reads each device's latest time). ``admit``/``admit_batch`` are the whole path: contract,
    dedup, rate limits, then remember what was accepted (:class:`IngestMemory`); they count every
    rejection.
    """

    def __init__(self, schema: dict, settings: IngestSettings, name: str = "ingest"):
        self.settings = settings
        self.name = name
        self.schema = fastavro.parse_schema(plain(schema))
        self.fields = {f["name"]: f for f in schema["fields"]}
        self._field_names = frozenset(self.fields)
        self._nullable = tuple(n for n, f in self.fields.items() if isinstance(f["type"], list) and "null" in f["type"])
        self._field_prefix = f"{self.schema['name']}."
        checks = {f["name"]: _type_check(f["type"]) for f in schema["fields"]}
        self._checks = checks if all(checks.values()) else None  # None: a richer contract, fastavro validates
        allowed = {f["name"]: _allowed_types(f["type"]) for f in schema["fields"]}
        self._allowed = allowed if all(allowed.values()) else None  # the batch path's type check
        #: integer fields and the Avro range of each (int: 32 bits, long: 64 bits), for the batch path
        self._int_ranges = {f["name"]: _INT32 if _base_type(f["type"]) == "int" else _INT64
                            for f in schema["fields"] if _base_type(f["type"]) in ("int", "long")}
        self.memory = IngestMemory(settings.dedup_window, settings.rate_limits.max_keys,
                                   track_time=settings.max_out_of_order_ms is not None)
        self.rate_limiter = RateLimiter(settings.rate_limits)

    # -- the contract --------------------------------------------------------------
    def validate(self, key: bytes | None, value: bytes | None, now_ms: int) -> dict:
        """A JSON reading (bytes) checked against the contract."""
        key_text = self._sized_key(key, value)
        if len(value) >= HEADER.size and value[0] == MAGIC_BYTE:  # no JSON text starts with a NUL byte
            _, schema_id = HEADER.unpack_from(value)
            raise Rejected("avro_on_json_topic", f"value is Confluent-framed Avro (magic byte 0, schema id {schema_id}) "
                                                 "on a topic declared JSON: its producer writes the wrong format")
        try:
            value.decode("utf-8")  # a precise reason for bad bytes; orjson would only say "not JSON"
        except UnicodeDecodeError as exc:
            raise Rejected("not_utf8", f"value is not UTF-8: {exc}") from None
        try:
            reading = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise Rejected("bad_json", f"value is not JSON: {exc}") from None
        return self.validate_reading(reading, key_text, now_ms)

    def validate_avro(self, key: bytes | None, value: bytes | None, now_ms: int, codec: AvroCodec) -> dict:
        """A Confluent-framed Avro reading, read into the contract's schema, then checked like JSON."""
        key_text = self._sized_key(key, value)
        if len(value) < HEADER.size:
            raise Rejected("truncated", f"value of {len(value)} bytes is shorter than the 5-byte Avro header")
        magic, schema_id = HEADER.unpack_from(value)
        if magic != MAGIC_BYTE:
            raise Rejected("bad_magic", f"magic byte {magic} is not {MAGIC_BYTE}: not Confluent-framed Avro")
        if schema_id == codec.schema_id:
            writer = codec.schema
        else:
            try:
                writer = codec.registry.parsed(schema_id)
            except WireFormatError as exc:
                cause = exc.__cause__
                if isinstance(cause, SchemaRegistryError) and cause.http_status_code == 404:
                    raise Rejected("unknown_schema", f"schema id {schema_id} is not in the registry") from None
                raise  # the registry is unreachable or failing: stop, retry after the restart, drop nothing
        buf = io.BytesIO(value)
        buf.seek(HEADER.size)
        try:
            record = fastavro.schemaless_reader(buf, writer, None if writer is codec.schema else codec.schema)
        except EOFError:
            raise Rejected("truncated", f"Avro record (schema id {schema_id}) ends early: truncated") from None
        except SchemaResolutionError as exc:
            field_path, why = self._resolution_problem(codec, schema_id)
            raise Rejected("schema", f"writer schema id {schema_id} cannot be read as the contract: {why or exc}",
                           field=field_path) from None
        except Exception as exc:  # corrupt varints, bad union index, invalid UTF-8 in a string, ...
            raise Rejected("bad_avro", f"cannot decode Avro with schema id {schema_id}: {type(exc).__name__}: {exc}") from None
        if buf.tell() != len(value):
            raise Rejected("bad_avro", f"{len(value) - buf.tell()} trailing bytes after the Avro record (schema id {schema_id})")
        return self._semantics(record, key_text, now_ms)

    def _resolution_problem(self, codec: AvroCodec, schema_id: int) -> tuple[str | None, str | None]:
        """The first field (and the rule) that keeps the writer schema from resolving to the contract."""
        try:
            writer_text = codec.registry.client.get_schema(schema_id).schema_str
            problems = compatibility.check(codec.schema_json, writer_text)
        except Exception:  # the explanation is a courtesy; the record is refused either way
            return None, None
        if not problems:
            return None, None
        path = problems[0].split(": ", 1)[0]
        return path.removeprefix(f"{self.schema['name'].rpartition('.')[2]}."), problems[0]

    def validate_reading(self, reading: Any, key_text: str | None, now_ms: int) -> dict:
        """An already-parsed JSON value checked against the contract (the HTTP path parses once per request)."""
        if not isinstance(reading, dict):
            raise Rejected("bad_json", f"value is a JSON {type(reading).__name__}, expected an object")
        if not self._field_names.issuperset(reading):
            unknown = sorted(set(reading) - self._field_names)
            raise Rejected("schema", f"unknown field(s) {', '.join(unknown)}", field=unknown[0])
        record = {}
        for name, spec in self.fields.items():
            if name in reading:
                record[name] = reading[name]
            elif "default" in spec:
                record[name] = spec["default"]
            else:
                raise Rejected("schema", f"field '{name}' is required", field=name)
        if self._checks is not None:
            for name, check in self._checks.items():
                if not check(record[name]):
                    raise Rejected("schema", f"does not match the contract: field '{name}' is {record[name]!r} "
                                             f"({type(record[name]).__name__}), expected {_describe(self.fields[name]['type'])}",
                                   field=name)
            return self._semantics(record, key_text, now_ms)
        try:
            fastavro.validate(record, self.schema, raise_errors=True)
        except AvroValidationError as exc:
            errors = exc.errors or []
            path = errors[0].field.removeprefix(self._field_prefix) if errors and errors[0].field else None
            raise Rejected("schema", f"does not match the contract: {'; '.join(str(e) for e in errors) or exc}",
                           field=path) from None
        return self._semantics(record, key_text, now_ms)

    def _sized_key(self, key: bytes | None, value: bytes | None) -> str | None:
        if value is None:
            raise Rejected("empty", "record has no value")
        if len(value) > self.settings.max_record_bytes:
            raise Rejected("oversize", f"record of {len(value)} bytes exceeds max_record_bytes={self.settings.max_record_bytes}")
        try:
            return key.decode("utf-8") if key is not None else None
        except UnicodeDecodeError:
            raise Rejected("bad_key", "key is not UTF-8") from None

    def _semantics(self, record: dict, key_text: str | None, now_ms: int) -> dict:
        """Ranges, key = entity, timestamp sanity: what the Avro types alone cannot say."""
        s = self.settings
        for name, (lo, hi) in s.ranges.items():
            v = record.get(name)
            if v is not None and not (lo <= v <= hi):
                raise Rejected("out_of_range", f"field '{name}'={v} outside [{lo}, {hi}]", field=name)
        entity = record.get(s.entity_field)
        if key_text is not None and entity is not None and key_text != entity:
            raise Rejected("key_mismatch", f"key '{key_text}' != {s.entity_field} '{entity}'", field=s.entity_field)
        ts = record.get(s.time_field)
        if ts is not None:
            if ts > now_ms + s.max_future_skew_ms:
                raise Rejected("future_timestamp", f"{s.time_field} is {(ts - now_ms) / 1000:.1f}s in the future "
                                                   f"(max_future_skew_ms={s.max_future_skew_ms})", field=s.time_field)
            if ts < now_ms - s.max_age_ms:
                raise Rejected("too_old", f"{s.time_field} is {(now_ms - ts) / 1000:.1f}s old (max_age_ms={s.max_age_ms})",
                               field=s.time_field)
            if s.max_out_of_order_ms is not None and entity is not None:
                latest = self.memory.latest.get(entity)
                if latest is not None and ts < latest - s.max_out_of_order_ms:
                    raise Rejected("out_of_order", f"{s.time_field} is {(latest - ts) / 1000:.1f}s behind the latest reading "
                                                   f"of {entity} (max_out_of_order_ms={s.max_out_of_order_ms})",
                                   field=s.time_field)
        return record

    # -- what was accepted ---------------------------------------------------------
    def accept(self, record: dict) -> None:
        """Remember an accepted record (:class:`IngestMemory`), and count its optional fields left empty."""
        s = self.settings
        for name in self._nullable:
            if record[name] is None:
                FIELD_MISSING.labels(self.name, name).inc()
        self.memory.remember(record[s.id_field], record.get(s.entity_field), record.get(s.time_field))

    def forget(self, records: Iterable[dict]) -> None:
        """Undo ``accept`` for records whose delivery failed, so the producer's retry is not taken for a duplicate."""
        self.memory.forget(record[self.settings.id_field] for record in records)

    # -- the whole path --------------------------------------------------------------
    def admit(self, key: bytes | None, value: bytes | None, now_ms: int, *, client: str | None = None,
              now_s: float | None = None, codec: AvroCodec | None = None) -> dict | None:
        """Contract, dedup, rate limits for one record: the record, or None for a duplicate (counted).

        ``codec`` set: the value is Confluent-framed Avro, else JSON. ``now_s`` is the rate
        limiter's clock (the Kafka path passes the record's timestamp, so a backlog read fast
        is limited at the rate it was produced, not at the rate it is read).
        """
        try:
            record = self.validate_avro(key, value, now_ms, codec) if codec is not None else self.validate(key, value, now_ms)
            if self.memory.seen(record[self.settings.id_field]):
                DUPLICATES.labels(self.name).inc()
                return None
            self.rate_limiter.throttle({record[self.settings.entity_field]: 1}, client,
                                       time.monotonic() if now_s is None else now_s)
        except Rejected as exc:
            self.count(exc)
            raise
        self.accept(record)
        return record

    def admit_clean(self, keys: list[bytes | None], values: list[bytes | None],
                    now_ms: list[int]) -> dict[str, list] | None:
        """The whole JSON path for a batch in which every reading is new and passes every check:
        the accepted records as columns, remembered as ``admit`` remembers them. ``None`` (and
        nothing remembered) as soon as any reading would be rejected, is a duplicate, is missing
        an optional field, or a rate limit is declared: then the batch goes through ``admit`` one
        reading at a time, which says precisely what is wrong with which. Same checks, same
        outcome for a clean batch, a fraction of the cost.
        """
        s = self.settings
        if self._allowed is None or self.rate_limiter.declared:
            return None
        if None in values or max(map(len, values)) > s.max_record_bytes:
            return None
        try:
            key_texts = [k.decode("utf-8") if k is not None else None for k in keys]
            readings = list(map(orjson.loads, values))
        except (UnicodeDecodeError, orjson.JSONDecodeError):
            return None
        names = self._field_names
        if set(map(type, readings)) != {dict} or not all(map(operator.eq, map(dict.keys, readings), repeat(names))):
            return None
        columns = {name: [r[name] for r in readings] for name in self.fields}
        for name, allowed in self._allowed.items():
            if not allowed.issuperset(map(type, columns[name])):
                return None
        try:
            for name, bound in self._int_ranges.items():
                present = [v for v in columns[name] if v is not None]
                if present and not (-bound <= min(present) and max(present) < bound):
                    return None
            for name, (lo, hi) in s.ranges.items():
                if name in columns:
                    col = np.array(columns[name], dtype=np.float64)  # nulls become NaN: not checked, like admit
                    if ((col < lo) | (col > hi)).any():
                        return None
        except (OverflowError, TypeError, ValueError):
            return None
        ts = columns.get(s.time_field)
        if ts is not None:
            if None in ts:
                return None
            ahead = [t - now for t, now in zip(ts, now_ms)]  # exact, as admit compares
            if max(ahead) > s.max_future_skew_ms or min(ahead) < -s.max_age_ms:
                return None
        entities = columns.get(s.entity_field)
        if entities is not None and key_texts != entities and any(
                k is not None and e is not None and k != e for k, e in zip(key_texts, entities)):
            return None
        ids = columns[s.id_field]
        if self.memory.seen_any(ids):
            return None
        if s.max_out_of_order_ms is not None and entities is not None and ts is not None:
            latest: dict[str, int] = {}
            remembered = self.memory.latest
            for entity, t in zip(entities, ts):
                if entity is None:
                    continue
                known = latest.get(entity, remembered.get(entity))
                if known is not None and t < known - s.max_out_of_order_ms:
                    return None
                latest[entity] = t if known is None or t > known else known
        # every reading passes: remember them as accept() would
        for name in self._nullable:
            if missing := columns[name].count(None):
                FIELD_MISSING.labels(self.name, name).inc(missing)
        self.memory.remember_all(ids, entities, ts)
        return columns

    def count(self, exc: Rejected, n: int = 1) -> None:
        """Count a rejection by reason, and by field when one field caused it (input quality per field)."""
        REJECTED.labels(self.name, exc.reason).inc(n)
        if exc.field:
            FIELD_REJECTED.labels(self.name, exc.field, exc.reason).inc(n)

    def admit_batch(self, readings: Iterable[Any], now_ms: int, *, client: str | None = None, now_s: float | None = None,
                    atomic: bool = True, sizes: Iterable[int] | None = None) -> BatchVerdict:
        """Parsed JSON readings (one request, one message): the verdict for each.

        ``atomic``: if any reading breaks the contract none is accepted (the HTTP answer is a 400
        naming them). Rate limits are all-or-nothing for the batch (the answer is a 429). ``sizes``
        are the encoded size of each reading, checked against ``max_record_bytes``.
        """
        verdict = BatchVerdict()
        candidates: list[tuple[int, dict]] = []
        in_batch: set[str] = set()
        sizes_it = iter(sizes) if sizes is not None else None
        for index, reading in enumerate(readings):
            size = next(sizes_it) if sizes_it is not None else 0
            try:
                if size > self.settings.max_record_bytes:
                    raise Rejected("oversize", f"reading of {size} bytes exceeds max_record_bytes={self.settings.max_record_bytes}")
                record = self.validate_reading(reading, None, now_ms)
            except Rejected as exc:
                verdict.rejected.append((index, exc))
                continue
            if self.memory.seen(record[self.settings.id_field]) or record[self.settings.id_field] in in_batch:
                verdict.duplicates += 1
                continue
            in_batch.add(record[self.settings.id_field])
            candidates.append((index, record))
        for _, exc in verdict.rejected:
            self.count(exc)
        if verdict.duplicates:
            DUPLICATES.labels(self.name).inc(verdict.duplicates)
        if verdict.rejected and atomic:
            return verdict
        devices: dict[str, int] = {}
        for _, record in candidates:
            devices[record[self.settings.entity_field]] = devices.get(record[self.settings.entity_field], 0) + 1
        try:
            self.rate_limiter.throttle(devices, client, time.monotonic() if now_s is None else now_s)
        except Rejected as exc:
            self.count(exc, len(candidates))
            verdict.throttled = exc
            return verdict
        for _, record in candidates:
            self.accept(record)
        verdict.accepted = candidates
        return verdict


def _text(header: bytes | None) -> str:
    return header.decode("utf-8", "replace") if header is not None else ""


def ingest_headers(event_id: str, trace_id: str, ingest_ms: int) -> dict[str, str]:
    """The headers of an accepted reading: its id, its trace (``trace_id``, or one derived from the
    event id) and the ingest hop's ``traceparent``, and when it entered Kafka (HTTP, MQTT or Kafka path alike)."""
    if trace_id:
        parent = traceparent(trace_id, event_id)
    else:  # derived from the event id, so replays reproduce it; one digest gives the trace id and the span id
        digest = hashlib.sha256(event_id.encode()).hexdigest()
        trace_id, parent = digest[:32], f"00-{digest[:32]}-{digest[32:48]}-01"
    return {H_EVENT_ID: event_id, H_TRACE_ID: trace_id, H_TRACEPARENT: parent, H_INGEST_MS: str(ingest_ms)}


class IngestValidator(Processor):
    """Raw JSON (or Avro) topic → validated Avro topic; rejects to the DLQ with the original bytes.

    The input's format comes from the topology: a ``json`` input is parsed as JSON, an ``avro``
    input is read as Confluent-framed Avro into the output's contract (any registered writer
    schema that resolves to it).
    """

    name = "ingest"

    def __init__(self, *, output_codec: AvroCodec, output_topic: str, dlq_topic: str, settings: IngestSettings,
                 input_codecs: Mapping[str, AvroCodec] | None = None, clock: Callable[[], float] = time.time):
        self.codec = output_codec
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.input_codecs = dict(input_codecs or {})
        self.clock = clock
        self.validator = Validator(output_codec.schema_json, settings, self.name)
        self.batch = output_codec.batch  # whole-batch path for clean JSON batches (None: contract not flat)

    @classmethod
    def build(cls, ctx: "BuildContext") -> "IngestValidator":
        (output,) = ctx.spec.outputs
        input_codecs = {}
        for topic in ctx.spec.inputs:
            if ctx.topology.topics[topic].format == "avro":
                input_codecs[topic] = ctx.codec(topic)
            elif ctx.topology.topics[topic].format != "json":
                raise TopologyError(f"processor {ctx.name!r}: input {topic!r} is {ctx.topology.topics[topic].format}; "
                                    "ingest reads json or avro topics")
        processor = cls(output_codec=ctx.codec(output), output_topic=output, dlq_topic=ctx.dlq,
                        settings=IngestSettings.model_validate(ctx.spec.params), input_codecs=input_codecs)
        processor.validator.name = ctx.name
        return processor

    def process(self, batch: list[Record]) -> list[Output]:
        wall_ms = int(self.clock() * 1000)
        by_record = self.validator.settings.reference_time == "record"
        if self.batch is not None and all(r.topic not in self.input_codecs for r in batch):
            now_ms = [r.timestamp_ms for r in batch] if by_record else [wall_ms] * len(batch)
            clean = self.validator.admit_clean([r.key for r in batch], [r.value for r in batch], now_ms)
            if clean is not None:
                return self._outputs(batch, clean)
        self._writer_schemas(batch)
        outputs: list[Output] = []
        for record in batch:
            now_ms = record.timestamp_ms if by_record else wall_ms
            try:
                reading = self.validator.admit(record.key, record.value, now_ms, client=record.header(H_CLIENT_ID) or None,
                                               now_s=record.timestamp_ms / 1000, codec=self.input_codecs.get(record.topic))
            except Rejected as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, exc.reason))
                continue
            if reading is None:  # a duplicate: dropped on purpose, counted
                continue
            headers = ingest_headers(reading[self.validator.settings.id_field], record.header(H_TRACE_ID), record.timestamp_ms)
            outputs.append(Output(self.output_topic, reading[self.validator.settings.entity_field],
                                  self.codec.encode(reading), headers))
        return outputs

    def _writer_schemas(self, batch: list[Record]) -> None:
        """Fetch the writer schemas of the batch's Avro records before any reading is admitted (admitting
        remembers ids for dedup): a registry that does not answer puts the whole batch back (backpressure),
        never half of it. An id the registry does not know is left for ``admit`` to reject."""
        wanted: dict[int, AvroCodec] = {}
        for record in batch:
            codec = self.input_codecs.get(record.topic)
            value = record.value
            if codec is not None and value is not None and len(value) >= HEADER.size and value[0] == MAGIC_BYTE:
                schema_id = HEADER.unpack_from(value)[1]
                if schema_id != codec.schema_id:
                    wanted.setdefault(schema_id, codec)
        for schema_id, codec in wanted.items():
            try:
                codec.registry.parsed(schema_id)
            except WireFormatError:
                pass  # unknown to the registry: that record is rejected with the reason

    def _outputs(self, batch: list[Record], columns: dict[str, list]) -> list[Output]:
        """The outputs of a batch the validator accepted whole: encoded as one batch, same headers as one by one."""
        values = self.batch.encode(columns, len(batch))
        topic = self.output_topic
        return [Output(topic, entity, value, ingest_headers(event_id, _text(record.headers.get(H_TRACE_ID)), record.timestamp_ms))
                for record, event_id, entity, value
                in zip(batch, columns[self.validator.settings.id_field], columns[self.validator.settings.entity_field], values)]
