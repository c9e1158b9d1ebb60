"""Ingest (seed node 1): raw readings → validated Avro on the ingest topic, the rest to the DLQ.

``Validator`` is the one validation path every ingest adapter shares: size,
encoding, JSON, the Avro contract (required fields, types, no unknown fields),
value ranges declared in the topology, timestamp sanity and dedup by
``event_id``. It is a plain class with no I/O, so it is tested without Kafka.
``IngestValidator`` is the Kafka adapter: raw JSON topic → Avro topic.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

import fastavro
from fastavro.validation import ValidationError as AvroValidationError
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from streams.avro import AvroCodec, _plain
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, H_INGEST_MS, H_TRACE_ID, Output, Processor, Record, dead_letter

DUPLICATES = Counter("tangram_ingest_duplicates_total", "Readings dropped as duplicates of an event_id already accepted.", ["processor"])


class Rejected(Exception):
    """A reading that breaks the contract. ``reason`` is a short stable code for the DLQ header."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class IngestSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_record_bytes: int = Field(4096, ge=64, description="Larger readings are rejected as oversize.")
    max_future_skew_ms: int = Field(30_000, ge=0, description="How far ahead of the broker's clock an event time may be.")
    max_age_ms: int = Field(3_600_000, ge=0, description="How far behind the broker's clock an event time may be.")
    dedup_window: int = Field(100_000, ge=0, description="How many recent event_ids are remembered for dedup.")
    ranges: dict[str, tuple[float, float]] = Field(default_factory=dict, description="field → [min, max] inclusive.")
    entity_field: str = Field("device_id", description="The field that must equal the Kafka key.")
    time_field: str = Field("ts", description="The event-time field (epoch ms).")


class Validator:
    """Turns raw bytes into a record that satisfies the contract, or raises ``Rejected``."""

    def __init__(self, schema: dict, settings: IngestSettings):
        self.settings = settings
        self.schema = fastavro.parse_schema(_plain(schema))
        self.fields = {f["name"]: f for f in schema["fields"]}
        self._seen: OrderedDict[str, None] = OrderedDict()

    def validate(self, key: bytes | None, value: bytes | None, now_ms: int) -> dict:
        s = self.settings
        if value is None:
            raise Rejected("empty", "record has no value")
        if len(value) > s.max_record_bytes:
            raise Rejected("oversize", f"record of {len(value)} bytes exceeds max_record_bytes={s.max_record_bytes}")
        try:
            key_text = key.decode("utf-8") if key is not None else None
        except UnicodeDecodeError:
            raise Rejected("bad_key", "key is not UTF-8") from None
        try:
            reading = json.loads(value.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise Rejected("not_utf8", f"value is not UTF-8: {exc}") from None
        except json.JSONDecodeError as exc:
            raise Rejected("bad_json", f"value is not JSON: {exc.msg} at position {exc.pos}") from None
        if not isinstance(reading, dict):
            raise Rejected("bad_json", f"value is a JSON {type(reading).__name__}, expected an object")
        unknown = sorted(set(reading) - set(self.fields))
        if unknown:
            raise Rejected("schema", f"unknown field(s) {', '.join(unknown)}")
        record = {}
        for name, spec in self.fields.items():
            if name in reading:
                record[name] = reading[name]
            elif "default" in spec:
                record[name] = spec["default"]
            else:
                raise Rejected("schema", f"field '{name}' is required")
        try:
            fastavro.validate(record, self.schema, raise_errors=True)
        except AvroValidationError as exc:
            raise Rejected("schema", f"does not match the contract: {'; '.join(str(e) for e in exc.errors) or exc}") from None
        for name, (lo, hi) in s.ranges.items():
            v = record.get(name)
            if v is not None and not (lo <= v <= hi):
                raise Rejected("out_of_range", f"field '{name}'={v} outside [{lo}, {hi}]")
        entity = record.get(s.entity_field)
        if key_text is not None and entity is not None and key_text != entity:
            raise Rejected("key_mismatch", f"key '{key_text}' != {s.entity_field} '{entity}'")
        ts = record.get(s.time_field)
        if ts is not None:
            if ts > now_ms + s.max_future_skew_ms:
                raise Rejected("future_timestamp", f"{s.time_field} is {(ts - now_ms) / 1000:.1f}s in the future "
                                                   f"(max_future_skew_ms={s.max_future_skew_ms})")
            if ts < now_ms - s.max_age_ms:
                raise Rejected("too_old", f"{s.time_field} is {(now_ms - ts) / 1000:.1f}s old (max_age_ms={s.max_age_ms})")
        return record

    def is_duplicate(self, event_id: str) -> bool:
        """Remember ``event_id``; True if it was seen within the dedup window."""
        if self.settings.dedup_window == 0:
            return False
        if event_id in self._seen:
            self._seen.move_to_end(event_id)
            return True
        self._seen[event_id] = None
        if len(self._seen) > self.settings.dedup_window:
            self._seen.popitem(last=False)
        return False


def new_trace_id() -> str:
    """A W3C trace id: 32 lowercase hex digits."""
    return uuid.uuid4().hex


class IngestValidator(Processor):
    """Raw JSON topic → validated Avro topic; rejects to the DLQ with the original bytes."""

    name = "ingest"

    def __init__(self, *, output_codec: AvroCodec, output_topic: str, dlq_topic: str, settings: IngestSettings):
        self.codec = output_codec
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.validator = Validator(output_codec.schema_json, settings)

    @classmethod
    def build(cls, ctx: "BuildContext") -> "IngestValidator":
        (output,) = ctx.spec.outputs
        return cls(output_codec=ctx.codec(output), output_topic=output, dlq_topic=ctx.dlq,
                   settings=IngestSettings.model_validate(ctx.spec.params))

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        now_ms = int(time.time() * 1000)
        for record in batch:
            try:
                reading = self.validator.validate(record.key, record.value, now_ms)
            except Rejected as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, exc.reason))
                continue
            if self.validator.is_duplicate(reading["event_id"]):
                DUPLICATES.labels(self.name).inc()
                continue
            headers = {
                H_EVENT_ID: reading["event_id"],
                H_TRACE_ID: record.header(H_TRACE_ID) or new_trace_id(),
                H_INGEST_MS: str(record.timestamp_ms),
            }
            outputs.append(Output(self.output_topic, reading[self.validator.settings.entity_field],
                                  self.codec.encode(reading), headers))
        return outputs

