"""Hostile input costs nothing: a property-based fuzz of every decoder and of both gateways.

For any input — random bytes, JSON of any shape, Confluent frames with unknown schema ids,
truncated or bit-flipped Avro bodies, odd headers and keys, bad credentials — each component
gives a clear answer (a record, or a ``Rejected`` with a known reason; an HTTP status from the
documented set with a JSON body; an MQTT acknowledgement), counts a dead letter for what it
refuses, never raises anything else, and loses none of the valid records sent between the
hostile ones. Hypothesis shrinks any counterexample to its smallest form.

Bounded time: the examples per test are fixed below (``FUZZ``), about twenty seconds in all
here; ``HYPOTHESIS_PROFILE=long`` runs many more on demand.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from types import SimpleNamespace
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reference import load_schema
from streams.avro import AvroCodec
from streams.columnar import BatchCodec
from streams.delivery import Output, Record
from streams.gateway.http import HttpGatewaySettings, make_app
from streams.gateway.mqtt import MESSAGES, MqttGateway, MqttGatewaySettings
from streams.gateway.stream import IngestStream
from streams.ingest import DUPLICATES, IngestSettings, IngestValidator, Rejected, Validator
from streams.security.keys import KeyRing, new_key
from streams.wire import HEADER, MAGIC_BYTE, WireFormatError, parse

settings.register_profile("tangram", max_examples=60, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "tangram"))

SUBJECT = "pm.ingest.telemetry-value"
SCHEMA = load_schema(SUBJECT)
SCHEMA_ID, OLD_ID = 7, 6
#: A writer schema the registry knows under OLD_ID: the contract without its last optional field.
OLD_SCHEMA = {**SCHEMA, "fields": [f for f in SCHEMA["fields"] if f["name"] != SCHEMA["fields"][-1]["name"]]}
REASONS = {"bad_avro", "bad_json", "bad_key", "bad_magic", "empty", "future_timestamp", "key_mismatch",
           "out_of_order", "out_of_range", "oversize", "rate_limited", "schema", "too_old", "truncated",
           "unknown_schema", "not_utf8", "avro_on_json_topic"}


class FakeRegistry:
    """The registry as a codec sees it: the contract under SCHEMA_ID, an older writer under OLD_ID, 404 otherwise."""

    def lookup(self, subject: str, text: str) -> int:
        return SCHEMA_ID

    def parsed(self, schema_id: int) -> Any:
        if schema_id == OLD_ID:
            return parse(OLD_SCHEMA)
        raise WireFormatError(f"unknown schema id {schema_id}") from SchemaRegistryError(404, 40403, "Schema not found")


def codec() -> AvroCodec:
    return AvroCodec(FakeRegistry(), SUBJECT, SCHEMA)  # type: ignore[arg-type]


def ingest_settings(**over: Any) -> IngestSettings:
    return IngestSettings(entity_field="device_id", time_field="ts", max_record_bytes=1024,
                          ranges={"vibration": (0.0, 100.0)}, **over)


def reading(device: str = "dev-1", **over: Any) -> dict:
    return {"event_id": uuid.uuid4().hex, "device_id": device, "ts": int(time.time() * 1000), "temperature": 60.0,
            "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0, **over}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20)
#: Readings that are almost right: one field replaced, dropped or added.
near_readings = st.builds(
    lambda field, value, drop: {k: v for k, v in {**reading(), field: value}.items() if k != drop},
    st.sampled_from([f["name"] for f in SCHEMA["fields"]] + ["extra"]), json_values,
    st.sampled_from([None, "ts", "device_id", "event_id"]))
hostile_json = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    near_readings.map(lambda r: json.dumps(r).encode()),
    st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"a": NaN}', b"1" * 5000, b"[" * 3000 + b"]" * 3000,
                     json.dumps(reading(vibration=1e308)).encode(), json.dumps(reading(ts=-1)).encode()]))


BODY = codec().encode(reading())  # one valid frame, cut and bent by the strategies below


def _frames(draw: st.DrawFn) -> bytes:
    body = BODY
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "id", "old", "magic"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        return body[: draw(st.integers(0, len(body) - 1))]
    if kind == "flipped":
        i = draw(st.integers(HEADER.size, len(body) - 1))
        return body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    if kind == "id":
        return HEADER.pack(MAGIC_BYTE, draw(st.integers(0, 2**32 - 1))) + body[HEADER.size:]
    if kind == "old":
        return HEADER.pack(MAGIC_BYTE, OLD_ID) + draw(st.binary(max_size=80))
    return HEADER.pack(draw(st.integers(-128, 127)), SCHEMA_ID) + body[HEADER.size:]


frames = st.composite(_frames)()
keys = st.none() | st.binary(max_size=40) | st.just(b"dev-1")


# -- the decoders -----------------------------------------------------------------------------------

@FUZZ
@given(value=hostile_json, key=keys)
def test_the_json_decoder_answers_every_value(value: bytes, key: bytes | None) -> None:
    validator = Validator(SCHEMA, ingest_settings(), "fuzz")
    try:
        record = validator.admit(key, value, int(time.time() * 1000), client="c")
    except Rejected as exc:
        assert exc.reason in REASONS and str(exc)
    else:
        assert record is None or set(record) == {f["name"] for f in SCHEMA["fields"]}


@FUZZ
@given(value=frames, key=keys)
def test_the_avro_decoder_answers_every_frame(value: bytes, key: bytes | None) -> None:
    avro = codec()
    validator = Validator(SCHEMA, ingest_settings(), "fuzz")
    try:
        validator.admit(key, value, int(time.time() * 1000), codec=avro)
    except Rejected as exc:
        assert exc.reason in REASONS and str(exc)
    try:
        avro.decode(value)
    except WireFormatError as exc:  # the one error a stage's decode may raise: the record is dead-lettered
        assert str(exc)


@FUZZ
@given(values=st.lists(frames | st.just(BODY), min_size=32, max_size=64))
def test_the_batch_decoder_reads_a_batch_exactly_or_not_at_all(values: list[bytes]) -> None:
    avro = codec()
    batch = BatchCodec(avro.schema_json, avro.header, small_batch=32, record_writer=avro.encode)
    columns = batch.decode(values)
    if columns is None:
        return  # read one by one, where every bad value gets its own error
    for i, value in enumerate(values):
        one = avro.decode(value)
        for name, column in columns.items():
            got = column[i]
            assert got == one[name] or (got != got and one[name] != one[name]), (i, name)


headers = st.dictionaries(st.sampled_from(["trace_id", "event_id", "client_id", "ingest_ms", "x", ""]),
                          st.binary(max_size=40), max_size=4)


@FUZZ
@given(items=st.lists(st.tuples(st.booleans(), hostile_json | frames, keys, headers), min_size=1, max_size=40))
def test_the_ingest_processor_dead_letters_the_hostile_and_keeps_every_valid_record(items) -> None:
    processor = IngestValidator(output_codec=codec(), output_topic="out", dlq_topic="dlq", settings=ingest_settings(),
                                clock=time.time)
    batch, valid = [], []
    for offset, (good, hostile, key, hdrs) in enumerate(items):
        if good:
            r = reading(f"dev-{offset % 3}")
            valid.append(r["event_id"])
            value, key = json.dumps(r).encode(), r["device_id"].encode()
        else:
            value = hostile
        batch.append(Record("raw", 0, offset, key, value, hdrs, int(time.time() * 1000)))
    duplicates = DUPLICATES.labels("ingest")._value.get()
    outputs = processor.process(batch)
    duplicates = DUPLICATES.labels("ingest")._value.get() - duplicates
    accepted = [codec().decode(o.value)["event_id"] for o in outputs if o.topic == "out"]
    dead = [o for o in outputs if o.topic == "dlq"]
    assert set(valid) <= set(accepted)  # none of the valid records between the hostile ones is lost
    assert all(o.headers["dlq.reason"] in REASONS for o in dead)  # each refusal says why
    assert len(accepted) + len(dead) + duplicates == len(batch)  # each record: its reading, its dead letter, or a counted duplicate


# -- the HTTP gateway -----------------------------------------------------------------------------

class MemorySink:
    """The gateway's sink, in memory: what the broker would have acknowledged."""

    def __init__(self) -> None:
        self.outputs: list[Output] = []

    async def deliver(self, outputs: list[Output]) -> None:
        self.outputs.extend(outputs)

    def produce(self, outputs: list[Output], done) -> None:
        self.outputs.extend(outputs)
        done([])

    def close(self) -> None:
        pass


class Keys:
    """The config center's view of the keys, for a key ring without Kafka."""

    def __init__(self, records: dict[str, dict]):
        self.records = records

    def get(self, namespace: str, key: str, default: Any = None) -> Any:
        return self.records.get(key, default)


def stream() -> IngestStream:
    return IngestStream("telemetry", Validator(SCHEMA, ingest_settings(), "telemetry"), codec(), "out", "dlq")


GOOD = new_key("fuzzer", "pm", ["telemetry"], rate_per_s=1e6, burst=10**6, dlq_per_hour=10**6)
OTHER = new_key("elsewhere", "pm", ["another"])
auth_headers = st.sampled_from([{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic Zm9vOmJhcg=="},
                                {"Authorization": f"Bearer {GOOD.token[:-1]}x"}, {"Authorization": f"Bearer {OTHER.token}"},
                                {"Authorization": GOOD.token}, {"Authorization": "Bearer " + "a" * 5000}])
requests = st.one_of(
    st.tuples(st.just("hostile body"), hostile_json, st.just("application/json"), st.just("telemetry")),
    st.tuples(st.just("batch"), st.lists(json_values | near_readings, max_size=5).map(lambda v: json.dumps(v).encode()),
              st.just("application/json"), st.just("telemetry")),
    st.tuples(st.just("content type"), st.binary(max_size=50), st.sampled_from(["text/plain", "", "application/x"]),
              st.just("telemetry")),
    st.tuples(st.just("stream"), st.just(b"{}"), st.just("application/json"),
              st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-.", min_size=1, max_size=30)),
    st.tuples(st.just("auth"), st.just(json.dumps(reading()).encode()), st.just("application/json"), auth_headers),
)
STATUSES = {200, 400, 401, 403, 404, 413, 415, 429}


@FUZZ
@given(sequence=st.lists(st.tuples(requests, st.booleans()), max_size=12))
# the client normalises /v1/streams/./events to a path no route takes: aiohttp's own 404, in JSON too
@example(sequence=[(("stream", b"{}", "application/json", "."), True)])
def test_the_http_gateway_answers_every_request_and_loses_no_valid_reading(sequence) -> None:
    sink = MemorySink()
    app = make_app("pm", {"telemetry": stream()}, sink,  # type: ignore[arg-type]
                   HttpGatewaySettings(max_body_bytes=4096, max_batch=50),
                   KeyRing(Keys({GOOD.key_id: GOOD.record.model_dump(), OTHER.key_id: OTHER.record.model_dump()})))
    good = {"Authorization": f"Bearer {GOOD.token}"}
    sent: list[str] = []
    refused_readings = 0

    async def run() -> None:
        nonlocal refused_readings
        async with TestClient(TestServer(app)) as client:
            for (kind, body, content_type, extra), then_valid in sequence:
                path, hdrs = "/v1/streams/telemetry/events", {**good, "Content-Type": content_type}
                if kind == "stream":
                    path = f"/v1/streams/{extra}/events"
                elif kind == "auth":
                    hdrs = {"Content-Type": content_type, **extra}
                before = len(sink.outputs)
                async with client.post(path, data=body, headers=hdrs) as r:
                    assert r.status in STATUSES, (kind, r.status, await r.text())
                    answer = await r.json()
                    assert r.status == 200 or answer["error"], answer
                    written = sink.outputs[before:]
                    dead = [o for o in written if o.topic == "dlq"]
                    if r.status == 400:  # every refused reading is a dead letter, counted; nothing else written
                        assert len(dead) == max(1, len(answer.get("errors", []))) == len(written)
                        refused_readings += len(dead)
                    elif r.status != 200:
                        assert written == []  # 401, 403, 404, 413, 415, 429: nothing written
                if then_valid:
                    r = reading()
                    sent.append(r["event_id"])
                    async with client.post("/v1/streams/telemetry/events", json=r, headers=good) as ok:
                        assert ok.status == 200, await ok.text()

    asyncio.run(run())
    accepted = {codec().decode(o.value)["event_id"] for o in sink.outputs if o.topic == "out"}
    assert set(sent) <= accepted
    assert sum(1 for o in sink.outputs if o.topic == "dlq") == refused_readings


# -- the MQTT gateway -----------------------------------------------------------------------------

@FUZZ
@given(messages=st.lists(st.tuples(st.booleans(), hostile_json, st.sampled_from(["pm/telemetry/dev-1", "pm/telemetry/x",
                                                                                 "pm/telemetry/" + "z" * 300])),
                         max_size=30))
def test_the_mqtt_gateway_acknowledges_every_message_and_loses_no_valid_reading(messages) -> None:
    sink = MemorySink()
    gateway = MqttGateway(stream(), ["pm/telemetry/+"], sink, MqttGatewaySettings(dlq_per_hour=10**6),  # type: ignore[arg-type]
                          client_id="fuzz")
    acked: list[int] = []
    gateway._ack = lambda msg: acked.append(msg.mid)  # the broker's side of the acknowledgement
    sent = []
    outcomes = ("accepted", "rejected", "duplicate", "dlq_budget")
    counted = {o: MESSAGES.labels("telemetry", o)._value.get() for o in outcomes}
    for mid, (good, hostile, topic) in enumerate(messages, start=1):
        if good:
            r = reading()
            sent.append(r["event_id"])
            payload = json.dumps(r).encode()
        else:
            payload = hostile
        gateway._on_message(gateway.client, None, SimpleNamespace(topic=topic, payload=payload, mid=mid, qos=1))
    assert sorted(acked) == list(range(1, len(messages) + 1))  # every message answered, once
    accepted = [codec().decode(o.value)["event_id"] for o in sink.outputs if o.topic == "out"]
    dead = [o for o in sink.outputs if o.topic == "dlq"]
    assert set(sent) <= set(accepted)
    assert all(o.headers["dlq.reason"] in REASONS for o in dead)
    delta = {o: MESSAGES.labels("telemetry", o)._value.get() - counted[o] for o in outcomes}
    assert delta["accepted"] == len(accepted) and delta["rejected"] == len(dead)
    assert sum(delta.values()) == len(messages)  # each message counted once: its reading, dead letter, or duplicate
