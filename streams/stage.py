"""The extension seam: a custom stage or sink of an application, in about twenty lines.

:class:`Stage` owns the plumbing every stateless stage repeats: decode each input record
(Avro topics through the registry, JSON topics with orjson, bytes as they are), dead-letter what
cannot be decoded or what the stage's own code fails on (the original bytes, the reason in the
headers), encode what it returns into the declared output topic's contract, carry the trace
headers (a record that entered Kafka without passing an ingest hop gets them: ``ingest_ms`` from its
Kafka timestamp and a trace id of its own) and give every output a deterministic ``event_id``. The delivery loop
(:mod:`streams.delivery`) does the rest: commit after the outputs are acknowledged, exactly-once
on request, backpressure. A stage of an app is a class in the app's plugin code, named in its
topology::

    processors:
      enrich:
        kind: my_app.stages:Enrich     # imported from the app folder
        inputs: [shop.ingest.orders]
        outputs: [shop.orders.scored]
        dlq: shop.dlq.enrich
        params: {threshold: 100.0}

    class Enrich(Stage):
        class Settings(StageSettings):
            threshold: float = 100.0

        def transform(self, value: dict, record: Record) -> dict | None:
            if value["amount"] < 0:
                raise ValueError("negative amount")        # → the DLQ, with this message
            return {**value, "large": value["amount"] > self.settings.threshold}

``transform`` returns one output value (to the only output topic), ``None`` (nothing), an
:class:`Emit` (another topic, key or event id) or a list of them. A service the stage needs being
down is not the record's fault: raise :class:`~streams.errors.BackpressureError` and the loop
pauses, backs off and retries the batch; anything else a record raises sends that record to the DLQ.
Override ``transform_batch`` to work on a whole micro-batch at once (one call to a model server).

:class:`Sink` is the same seam for a topic's way out of Kafka (a webhook, a database): ``write``
gets the decoded batch, and the loop commits its offsets only after ``write`` returned, so a
crash or an outage re-delivers what was not written (writes must be idempotent by ``event_id``).
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import orjson
from pydantic import BaseModel, ConfigDict

from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.context import BuildContext
from streams.delivery import (
    H_EVENT_ID, H_INGEST_MS, H_TRACE_ID, Output, Processor, Record, carry_headers, dead_letter,
)
from streams.errors import BackpressureError, TopologyError


class StageSettings(BaseModel):
    """Base of a stage's settings: the processor's ``params``, typed, frozen, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class Emit:
    """One output of a stage: its value, and where it goes when that is not the default."""

    value: dict | bytes
    topic: str | None = None  # default: the stage's only output topic
    key: str | None = None  # default: the input record's key (the entity)
    event_id: str | None = None  # default: derived from the input's event id and the stage


class _Codec:
    """A topic's values as the stage sees them: Avro through the registry, JSON, or raw bytes."""

    def __init__(self, topic: str, fmt: str, avro: AvroCodec | None):
        self.topic, self.format, self.avro = topic, fmt, avro

    def decode(self, data: bytes | None) -> Any:
        if self.avro is not None:
            return self.avro.decode(data)
        if data is None:
            raise WireFormatError(f"{self.topic}: the record has no value")
        if self.format == "json":
            try:
                return orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise WireFormatError(f"{self.topic}: value is not JSON: {exc}") from None
        return data

    def encode(self, value: Any) -> bytes:
        if self.avro is not None:
            return self.avro.encode(value)
        if self.format == "json":
            return orjson.dumps(value)
        if not isinstance(value, bytes):
            raise TypeError(f"{self.topic} is a bytes topic: emit bytes, not {type(value).__name__}")
        return value


class Stage(Processor):
    """A stateless stage: decoded input values → output values, the plumbing done here."""

    #: The stage's settings model; the processor's ``params`` are validated by it.
    Settings: ClassVar[type[StageSettings]] = StageSettings

    def __init__(self, ctx: BuildContext):
        spec = ctx.spec
        self.settings = ctx.settings(self.Settings)
        self.topology = ctx.topology
        self.dlq_topic = ctx.dlq
        self.inputs = {t: self._codec(ctx, t) for t in spec.inputs}
        self.outputs = {t: self._codec(ctx, t) for t in spec.outputs}
        self.default_output = spec.outputs[0] if len(spec.outputs) == 1 else None

    @classmethod
    def build(cls, ctx: BuildContext) -> Self:
        return cls(ctx)

    @staticmethod
    def _codec(ctx: BuildContext, topic: str) -> _Codec:
        spec = ctx.topology.topics[topic]
        return _Codec(topic, spec.format, ctx.codec(topic) if spec.format == "avro" else None)

    # -- what a stage writes -----------------------------------------------------------
    def transform(self, value: Any, record: Record) -> dict | bytes | Emit | Iterable[dict | bytes | Emit] | None:
        """The outputs of one decoded input value (see the module's doc). Raising dead-letters the record."""
        raise TopologyError(f"{type(self).__name__} overrides neither transform nor transform_batch")

    def transform_batch(self, values: Sequence[Any], records: Sequence[Record]) -> list[Any]:
        """The outputs of each value of a micro-batch, in order; an item that is an exception dead-letters
        its record. Default: ``transform`` per value."""
        results: list[Any] = []
        for value, record in zip(values, records):
            try:
                results.append(self.transform(value, record))
            except (BackpressureError, TopologyError):
                raise  # not the record's fault: retried after a back-off, or the app is wrong
            except Exception as exc:  # the record's fault: it goes to the DLQ with the reason, never blocks
                results.append(exc)
        return results

    # -- the plumbing ------------------------------------------------------------------
    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        records, values = self._decode(batch, outputs)
        if records:
            for record, result in zip(records, self.transform_batch(values, records), strict=True):
                outputs.extend(self._encode(record, result))
        return outputs

    def _decode(self, batch: list[Record], outputs: list[Output]) -> tuple[list[Record], list[Any]]:
        records, values = [], []
        for record in batch:
            try:
                values.append(self.inputs[record.topic].decode(record.value))
            except WireFormatError as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                continue
            records.append(record)
        return records, values

    def _encode(self, record: Record, result: Any) -> list[Output]:
        """The outputs of one record's result, or its dead letter when the result is an error or off-contract."""
        if isinstance(result, BaseException):
            return [dead_letter(record, self.dlq_topic, self.name, result, _reason(result))]
        if result is None:
            return []
        items = [result] if isinstance(result, (dict, bytes, Emit)) else list(result)
        source_id = record.header(H_EVENT_ID) or record.where
        outputs = []
        origin = _origin(record, source_id)
        try:
            for i, item in enumerate(items):
                emit = item if isinstance(item, Emit) else Emit(item)
                topic = emit.topic or self.default_output
                if topic not in self.outputs:
                    raise TopologyError(f"{self.name} emits to {topic!r}, which is not one of its outputs "
                                        f"{sorted(self.outputs)}" if topic else
                                        f"{self.name} has several outputs: an Emit must name its topic")
                event_id = emit.event_id or (emit.value.get("event_id") if isinstance(emit.value, Mapping) else None) \
                    or (f"{self.name}:{source_id}" if len(items) == 1 else f"{self.name}:{source_id}:{i}")
                key = emit.key if emit.key is not None else record.key
                outputs.append(Output(topic, key, self.outputs[topic].encode(emit.value),
                                      carry_headers(record, **{H_EVENT_ID: str(event_id)}, **origin)))
        except TopologyError:
            raise  # the app's code and its topology disagree: stop, no record is at fault
        except Exception as exc:  # a value the output contract refuses: the input record goes to the DLQ
            return [dead_letter(record, self.dlq_topic, self.name, exc, "output_contract")]
        return outputs


class Sink(Stage):
    """A topic's way out of Kafka: ``write`` each decoded micro-batch; offsets commit after it returns."""

    @abstractmethod
    def write(self, values: Sequence[Any], records: Sequence[Record]) -> Mapping[int, BaseException] | None:
        """Write the batch (idempotently by ``event_id``), within a deadline.

        Raise :class:`~streams.errors.BackpressureError` when the destination is unavailable (the batch is
        retried after a back-off); return ``{index: error}`` for values it refused (those go to the DLQ).
        """

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        records, values = self._decode(batch, outputs)
        if records:
            refused = self.write(values, records) or {}
            outputs.extend(dead_letter(records[i], self.dlq_topic, self.name, exc, _reason(exc))
                           for i, exc in sorted(refused.items()))
        return outputs


def _origin(record: Record, source_id: str) -> dict[str, str]:
    """The tracing headers a record that entered Kafka without an ingest hop lacks (a stage reading what
    producers wrote straight to a topic is that hop): when it entered Kafka, and a trace id of its own."""
    origin = {}
    if H_INGEST_MS not in record.headers and record.timestamp_ms > 0:
        origin[H_INGEST_MS] = str(record.timestamp_ms)
    if H_TRACE_ID not in record.headers:
        origin[H_TRACE_ID] = hashlib.sha256(source_id.encode()).hexdigest()[:32]
    return origin


def _reason(error: BaseException) -> str:
    """The DLQ reason of a record a stage's code refused: the error's class, snake_cased."""
    name = type(error).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))
