"""The upload gateway (streams.gateway.upload) without a broker: a multipart file in, the record it would produce.

The app's declaration is the document-intake app's own (``uploads:`` of its topology); the sink and the
codec are stand-ins that keep what they are given.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from reference import INTAKE
from streams.delivery import Output
from streams.gateway.errors import GatewayError
from streams.gateway.upload import Upload, UploadGatewaySettings, make_app
from streams.payloads import PayloadStore
from streams.topology import Topology, load_topology


class KeptCodec:
    def encode(self, record: dict) -> bytes:
        self.last = record
        return b"avro"


class KeptSink:
    def __init__(self, fail: bool = False):
        self.outputs: list[Output] = []
        self.fail = fail

    async def deliver(self, outputs: list[Output]) -> None:
        if self.fail:
            raise GatewayError("not acknowledged")
        self.outputs.extend(outputs)

    def close(self) -> None:
        pass


def post(tmp_path, parts: dict[str, Any], headers: dict[str, str], *, sink: KeptSink | None = None,
         inline_max_bytes: int = 100, content_type: str | None = None) -> tuple[int, dict, KeptSink, KeptCodec]:
    spec = load_topology(INTAKE).uploads["documents"]
    codec, sink = KeptCodec(), sink or KeptSink()
    upload = Upload("documents", spec, codec, PayloadStore(tmp_path, inline_max_bytes))  # type: ignore[arg-type]

    async def run() -> tuple[int, dict]:
        async with TestClient(TestServer(make_app({"documents": upload}, sink, UploadGatewaySettings()))) as client:
            if content_type:
                response = await client.post("/v1/uploads/documents", data=b"x", headers={**headers, "Content-Type": content_type})
            else:
                form = aiohttp.FormData()
                for name, (data, filename, kind) in parts.items():
                    form.add_field(name, data, filename=filename, content_type=kind)
                response = await client.post("/v1/uploads/documents", data=form, headers=headers)
            return response.status, await response.json()

    status, body = asyncio.run(run())
    return status, body, sink, codec


def test_a_curl_style_upload_becomes_one_keyed_record_with_the_ingest_headers(tmp_path):
    status, body, sink, codec = post(tmp_path, {"image": (b"\x89PNG small", "card.png", "image/png")},
                                     {"X-Device-ID": "counter-07", "X-Request-ID": "doc-1"})
    assert status == 202 and body == {"id": "doc-1", "bytes": 10, "stored": "inline"}
    [out] = sink.outputs
    assert out.topic == "intake.raw.documents" and out.key == "doc-1"
    assert out.headers["event_id"] == "doc-1" and int(out.headers["ingest_ms"]) > 0 and len(out.headers["trace_id"]) == 32
    record = codec.last
    assert record["device_id"] == "counter-07" and record["filename"] == "card.png" and record["content_type"] == "image/png"
    assert record["image"] == b"\x89PNG small" and record["image_ref"] is None and record["uploaded_ms"] > 0


def test_a_file_over_the_inline_limit_is_stored_and_referenced(tmp_path):
    data = b"\xff\xd8\xff" + b"j" * 500
    status, body, _, codec = post(tmp_path, {"image": (data, "scan.jpg", "image/jpeg")}, {"X-Device-ID": "c1"})
    assert status == 202 and body["stored"] == "reference" and len(body["id"]) == 32
    assert codec.last["image"] is None
    assert PayloadStore(tmp_path, 100).get(codec.last["image_ref"]) == data


@pytest.mark.parametrize("parts, headers, content_type, status, error", [
    ({"image": (b"x", "a.png", "image/png")}, {}, None, 400, "missing_header"),
    ({"photo": (b"x", "a.png", "image/png")}, {"X-Device-ID": "c1"}, None, 400, "no_file"),
    ({}, {"X-Device-ID": "c1"}, "application/json", 415, "content_type"),
    ({"image": (b"x" * 4_194_305, "a.png", "image/png")}, {"X-Device-ID": "c1"}, None, 413, "oversize"),
])
def test_refusals_say_why_and_write_nothing(tmp_path, parts, headers, content_type, status, error):
    got, body, sink, _ = post(tmp_path, parts, headers, content_type=content_type)
    assert (got, body["error"]) == (status, error) and sink.outputs == []


def test_a_broker_that_does_not_acknowledge_is_a_503_to_retry(tmp_path):
    status, body, _, _ = post(tmp_path, {"image": (b"x", "a.png", "image/png")}, {"X-Device-ID": "c1"},
                              sink=KeptSink(fail=True))
    assert status == 503 and body["error"] == "not_acknowledged"


def test_an_upload_whose_contract_lacks_a_declared_field_is_refused_at_load(tmp_path):
    doc = yaml.safe_load((INTAKE / "topology.yaml").read_text())
    doc["root"] = str(INTAKE)
    doc["uploads"]["documents"]["headers"]["X-Counter"] = "counter"
    with pytest.raises(ValueError, match="needs a string field 'counter'"):
        Topology.model_validate(doc)
    doc["uploads"]["documents"] = {"topic": "intake.dlq.intake", "id_field": "doc_id", "time_field": "uploaded_ms"}
    with pytest.raises(ValueError, match="not a declared Avro topic"):
        Topology.model_validate(doc)
