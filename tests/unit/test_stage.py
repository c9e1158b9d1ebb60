"""The extension seam (streams.stage): the plumbing a custom stage or sink gets, and the examples of
docs/apps.md run as written (no broker: codecs over a fake registry, batches of records built here)."""

from __future__ import annotations

import http.server
import json
import re
import sqlite3
import threading
from dataclasses import dataclass

import orjson
import pytest

from reference import REPO
from streams.avro import AvroCodec
from streams.context import BuildContext
from streams.delivery import Output, Record
from streams.errors import BackpressureError, TopologyError
from streams.settings import StackSettings
from streams.topology import Topology

ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "event_id", "type": "string"}, {"name": "entity", "type": "string"},
    {"name": "amount", "type": "double"}]}
SCORED = {**ORDER, "name": "Scored", "fields": [*ORDER["fields"], {"name": "large", "type": "boolean"}]}
ACTION = {"type": "record", "name": "Action", "namespace": "shop", "fields": [
    {"name": "event_id", "type": "string"}, {"name": "entity", "type": "string"}, {"name": "rule", "type": "string"}]}
SCHEMA = {"shop.ingest.orders-value": ORDER, "shop.orders.scored-value": SCORED, "shop.orders.review-value": SCORED,
          "shop.actions.alert-value": ACTION}


class FakeRegistry:
    ids = {subject: i for i, subject in enumerate(SCHEMA, start=1)}

    def lookup(self, subject: str, text: str) -> int:
        return self.ids[subject]

    def parsed(self, schema_id: int):
        from streams.wire import WireFormatError

        raise WireFormatError(f"unknown schema id {schema_id}")


@dataclass(frozen=True)
class FakeContext(BuildContext):
    """A build context whose codecs need no registry: the schemas above, ids from FakeRegistry."""

    def codec(self, topic: str) -> AvroCodec:
        subject = self.topology.topics[topic].schema_
        return AvroCodec(FakeRegistry(), subject, SCHEMA[subject])


def _topology(processor: dict) -> Topology:
    topics = {t: {"schema": f"{t}-value"} for t in ("shop.ingest.orders", "shop.orders.scored", "shop.orders.review",
                                                       "shop.actions.alert")}
    topics.update({"shop.raw.orders": {"format": "json"}, "shop.dlq.enrich": {"format": "bytes"}})
    return Topology.model_construct(app="shop", topics={k: _topic(v) for k, v in topics.items()},
                                    processors={"enrich": _processor(processor)})


def _topic(spec: dict):
    from streams.topology import TopicSpec

    return TopicSpec.model_validate(spec)


def _processor(spec: dict):
    from streams.topology import ProcessorSpec

    return ProcessorSpec.model_validate({"dlq": "shop.dlq.enrich", **spec})


def _examples() -> dict[str, type]:
    """The Python blocks of docs/apps.md that define classes, executed as a user's plugin module would be."""
    page = (REPO / "docs" / "apps.md").read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", page, re.DOTALL):
        if "\nclass " in f"\n{block}":
            exec(compile(block, "docs/apps.md", "exec"), namespace)  # noqa: S102 - our own documentation
    return {k: v for k, v in namespace.items() if isinstance(v, type)}


EXAMPLES = _examples()


def build(cls: type, spec: dict):
    stage = cls.build(FakeContext(_topology(spec), "enrich", StackSettings()))
    stage.name = "enrich"
    return stage


def record(value: bytes | None, offset: int = 0, topic: str = "shop.ingest.orders") -> Record:
    return Record(topic, 0, offset, b"o-1", value, {"event_id": f"order-{offset}".encode(), "trace_id": b"t" * 32}, 0)


ENRICH = {"kind": "x:Enrich", "inputs": ["shop.ingest.orders"], "outputs": ["shop.orders.scored", "shop.orders.review"],
          "params": {"threshold": 250.0, "review_topic": "shop.orders.review"}}


def orders(*amounts: float) -> list[Record]:
    codec = AvroCodec(FakeRegistry(), "shop.ingest.orders-value", ORDER)
    return [record(codec.encode({"event_id": f"order-{i}", "entity": "o-1", "amount": a}), i) for i, a in enumerate(amounts)]


def test_the_documented_stage_transforms_routes_and_dead_letters():
    stage = build(EXAMPLES["Enrich"], ENRICH)
    out = stage.process([*orders(10.0, 300.0, -5.0), record(b"\x00\x00\x00\x00\x01garbage", 3)])
    by_topic: dict[str, list[Output]] = {}
    for o in out:
        by_topic.setdefault(o.topic, []).append(o)
    scored = [stage.outputs["shop.orders.scored"].decode(o.value) for o in by_topic["shop.orders.scored"]]
    assert [(s["amount"], s["large"]) for s in scored] == [(10.0, False), (300.0, True)]
    assert len(by_topic["shop.orders.review"]) == 1
    # each output: a deterministic event id (its value's own `event_id` here), the input's trace, the input's key
    ids = [o.headers["event_id"] for o in out if o.topic != "shop.dlq.enrich"]
    assert ids == ["order-0", "order-1", "order-1"]
    assert all(o.headers["trace_id"] == b"t" * 32 and o.key == b"o-1" for o in out if o.topic != "shop.dlq.enrich")
    dead = {o.headers["dlq.reason"]: o for o in by_topic["shop.dlq.enrich"]}
    assert set(dead) == {"value_error", "undecodable"}
    assert "negative amount -5.0" in dead["value_error"].headers["dlq.error_message"]
    assert dead["undecodable"].value == b"\x00\x00\x00\x00\x01garbage"  # the original bytes, untouched


def test_a_value_the_output_contract_refuses_is_a_dead_letter_not_a_crash():
    from streams.stage import Stage

    class Broken(Stage):
        def transform(self, value, record):
            return {"event_id": value["event_id"]}  # misses the contract's fields

    stage = build(Broken, {**ENRICH, "outputs": ["shop.orders.scored"], "params": {}})
    [dead] = stage.process(orders(1.0))
    assert dead.topic == "shop.dlq.enrich" and dead.headers["dlq.reason"] == "output_contract"


def test_an_emit_to_a_topic_the_stage_does_not_declare_stops_the_stage():
    from streams.stage import Emit, Stage

    class Stray(Stage):
        def transform(self, value, record):
            return Emit(value, topic="shop.elsewhere")

    stage = build(Stray, {**ENRICH, "params": {}})
    with pytest.raises(TopologyError, match="not one of its outputs"):
        stage.process(orders(1.0))


def test_an_outage_is_backpressure_not_a_dead_letter():
    from streams.stage import Stage

    class NeedsAService(Stage):
        def transform(self, value, record):
            raise BackpressureError("the service is down")

    stage = build(NeedsAService, {**ENRICH, "params": {}})
    with pytest.raises(BackpressureError):
        stage.process(orders(1.0, 2.0))


def test_json_inputs_decode_with_orjson_and_settings_are_validated():
    from streams.stage import Stage

    class Parse(Stage):
        def transform(self, value, record):
            return {"event_id": value["id"], "entity": "o-1", "amount": float(value["amount"])}

    stage = build(Parse, {**ENRICH, "inputs": ["shop.raw.orders"], "outputs": ["shop.ingest.orders"], "params": {}})
    out = stage.process([record(orjson.dumps({"id": "a", "amount": 3}), 0, "shop.raw.orders"),
                         record(b"{not json", 1, "shop.raw.orders")])
    [ok] = [o for o in out if o.topic == "shop.ingest.orders"]
    assert ok.headers["event_id"] == "a"
    [dead] = [o for o in out if o.topic == "shop.dlq.enrich"]
    assert stage.outputs["shop.ingest.orders"].decode(ok.value)["amount"] == 3.0
    assert dead.headers["dlq.reason"] == "undecodable" and dead.value == b"{not json"
    with pytest.raises(TopologyError, match="threshold"):
        build(EXAMPLES["Enrich"], {**ENRICH, "params": {"threshold": "high", "review_topic": "x"}})


ALERTS = {"kind": "x:SqliteSink", "inputs": ["shop.actions.alert"]}


def alerts(*entities: str) -> list[Record]:
    codec = AvroCodec(FakeRegistry(), "shop.actions.alert-value", ACTION)
    return [record(codec.encode({"event_id": f"a{i}", "entity": e, "rule": "high"}), i, "shop.actions.alert")
            for i, e in enumerate(entities)]


def test_the_documented_sink_writes_idempotently_and_dead_letters_what_it_refuses(tmp_path):
    sink = build(EXAMPLES["SqliteSink"], {**ALERTS, "params": {"path": str(tmp_path / "a.db")}})
    sink.setup()
    try:
        out = sink.process(alerts("s1", "", "s2"))
        assert [o.headers["dlq.reason"] for o in out] == ["value_error"]
        assert sink.process(alerts("s1", "", "s2"))  # delivered again after a crash: the same rows, no duplicates
    finally:
        sink.close()
    rows = sqlite3.connect(tmp_path / "a.db").execute("SELECT event_id, entity FROM actions ORDER BY 1").fetchall()
    assert rows == [("a0", "s1"), ("a2", "s2")]


class _Hook(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(self.answers.pop(0))
        self.end_headers()
        self.wfile.write(b"nope")

    def log_message(self, *_: object) -> None:
        pass


def test_the_webhook_sink_commits_on_2xx_retries_on_5xx_and_dead_letters_on_4xx():
    from streams.sinks import WebhookSink

    server = http.server.HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sink = build(WebhookSink, {**ALERTS, "params": {"url": f"http://127.0.0.1:{server.server_port}/hook"}})
        sink.setup()
        # a 503 is tried again (its guard: the default two retries with jittered backoff), then backpressure
        _Hook.answers[:] = [200, 503, 200, 503, 503, 503, 422]
        assert sink.process(alerts("s1", "s2")) == []
        assert sink.process(alerts("s3")) == []  # the second try was answered
        with pytest.raises(BackpressureError, match="503"):
            sink.process(alerts("s3b"))
        dead = sink.process(alerts("s4", "s5"))
        assert [o.headers["dlq.reason"] for o in dead] == ["webhook_error", "webhook_error"]
        assert "422" in dead[0].headers["dlq.error_message"]
        assert [r["entity"] for r in _Hook.bodies[0]["records"]] == ["s1", "s2"]
    finally:
        server.shutdown()


def test_an_undecodable_input_is_dead_lettered_and_never_reaches_the_sink():
    from streams.stage import Sink

    class Recorder(Sink):
        written: list = []

        def write(self, values, records):
            self.written.extend(v["entity"] for v in values)

    sink = build(Recorder, ALERTS)
    [dead] = sink.process([*alerts("s1"), record(b"\x00\x00", 5, "shop.actions.alert"), *alerts("s2")[:0]])
    assert dead.headers["dlq.reason"] == "undecodable" and dead.value == b"\x00\x00"
    assert Recorder.written == ["s1"]


def test_a_record_that_skipped_an_ingest_hop_gets_its_ingest_time_and_a_trace_from_the_stage():
    """A producer writing straight to a stage's input (no gateway, no ingest processor) sets no headers:
    the stage stamps when the record entered Kafka and a trace id of its own, so latency and traces work."""
    from streams.stage import Stage

    class Copy(Stage):
        def transform(self, value, record):
            return {**value, "large": False}

    stage = build(Copy, {**ENRICH, "outputs": ["shop.orders.scored"], "params": {}})
    [bare] = orders(1.0)
    bare = bare._replace(headers={}, timestamp_ms=1_700_000_000_123)
    [out] = stage.process([bare])
    assert out.headers["ingest_ms"] == "1700000000123" and len(out.headers["trace_id"]) == 32
    assert out.headers["traceparent"].startswith(f"00-{out.headers['trace_id']}-")
    [traced] = stage.process(orders(1.0))  # a record that has them keeps them
    assert traced.headers["trace_id"] == b"t" * 32 and "ingest_ms" not in traced.headers
