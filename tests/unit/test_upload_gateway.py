"""The upload gateway (streams.gateway.upload) without a broker: a multipart file in, the record it would produce.

The app's declaration is the document-intake app's own (``uploads:`` of its topology); the sink and the
codec are stand-ins that keep what they are given; the keys are a key ring over a dict, as the config
center would hold them.
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
from streams.gateway.webapp import HEALTH_PATH
from streams.gateway.upload import Upload, UploadGatewaySettings, make_app
from streams.payloads import PayloadStore
from streams.security.keys import KeyRing, new_key
from streams.topology import Topology, load_topology

#: A key allowed to upload documents, one allowed only a gateway stream, and one at one upload a minute.
UPLOADER = new_key("counter-07", "intake", ["documents"])
STREAM_ONLY = new_key("sensor-site", "intake", ["scans"])
SLOW = new_key("slow-client", "intake", ["documents"], rate_per_s=1 / 60, burst=1)


class Keys:
    """The config center's keys namespace, as a key ring reads it."""

    def get(self, namespace, key, default=None):
        return {k.key_id: k.record.model_dump() for k in (UPLOADER, STREAM_ONLY, SLOW)}.get(key, default)


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
         inline_max_bytes: int = 100, content_type: str | None = None, key=UPLOADER, times: int = 1,
         name: str = "documents") -> tuple[int, dict, KeptSink, KeptCodec]:
    """POST the parts ``times`` with ``key`` (None: none shown); the last answer."""
    spec = load_topology(INTAKE).uploads["documents"]
    codec, sink = KeptCodec(), sink or KeptSink()
    upload = Upload("documents", spec, codec, PayloadStore(tmp_path, inline_max_bytes))  # type: ignore[arg-type]
    if key is not None:
        headers = {**headers, "Authorization": f"Bearer {key.token}"}
    app = make_app("intake", {"documents": upload}, sink, UploadGatewaySettings(), KeyRing(Keys()))

    async def run() -> tuple[int, dict]:
        async with TestClient(TestServer(app)) as client:
            for _ in range(times):
                response = await send(client)
            return response.status, await response.json()

    async def send(client: TestClient) -> aiohttp.ClientResponse:
        if content_type:
            return await client.post(f"/v1/uploads/{name}", data=b"x", headers={**headers, "Content-Type": content_type})
        form = aiohttp.FormData()
        for part, (data, filename, kind) in parts.items():
            form.add_field(part, data, filename=filename, content_type=kind)
        return await client.post(f"/v1/uploads/{name}", data=form, headers=headers)

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


@pytest.mark.parametrize("key, name, status, error", [
    (None, "documents", 401, "unauthorized"),  # no key shown
    (STREAM_ONLY, "documents", 403, "forbidden"),  # a key for the app's gateway stream, not its upload
    (None, "nope", 401, "unauthorized"),  # an unknown upload is not even named to a caller without a key
    (UPLOADER, "nope", 404, "unknown_upload"),
])
def test_only_a_key_allowed_to_write_the_upload_gets_in(tmp_path, key, name, status, error):
    got, body, sink, _ = post(tmp_path, {"image": (b"x", "a.png", "image/png")}, {"X-Device-ID": "c1"}, key=key,
                              name=name)
    assert (got, body["error"]) == (status, error) and sink.outputs == []


def test_a_key_over_its_rate_is_told_when_to_come_back_and_nothing_more_is_written(tmp_path):
    status, body, sink, _ = post(tmp_path, {"image": (b"x", "a.png", "image/png")}, {"X-Device-ID": "c1"}, key=SLOW,
                                 times=2)
    assert (status, body["error"]) == (429, "rate_limited") and len(sink.outputs) == 1


def test_auth_none_is_a_choice_made_on_purpose(tmp_path):
    spec = load_topology(INTAKE).uploads["documents"]
    upload = Upload("documents", spec, KeptCodec(), PayloadStore(tmp_path, 100))  # type: ignore[arg-type]
    with pytest.raises(GatewayError, match="key ring"):
        make_app("intake", {"documents": upload}, KeptSink(), UploadGatewaySettings(), None)
    assert make_app("intake", {"documents": upload}, KeptSink(), UploadGatewaySettings(auth="none"), None) is not None


def test_healthz_answers_without_a_key_while_uploads_still_need_one(tmp_path):
    """Kubernetes' probes and compose's healthcheck ask /healthz with no key: 200, and nothing is written."""
    spec = load_topology(INTAKE).uploads["documents"]
    sink = KeptSink()
    upload = Upload("documents", spec, KeptCodec(), PayloadStore(tmp_path, 100))  # type: ignore[arg-type]
    app = make_app("intake", {"documents": upload}, sink, UploadGatewaySettings(), KeyRing(Keys()))

    async def run() -> tuple[int, dict, int]:
        async with TestClient(TestServer(app)) as client:
            health = await client.get(HEALTH_PATH)
            keyless = await client.post("/v1/uploads/documents", data=b"x", headers={"Content-Type": "text/plain"})
            nowhere = await client.get("/v1/nowhere")  # no route: aiohttp's 404, answered in JSON like the rest
            return health.status, await health.json(), keyless.status, nowhere.status, (await nowhere.json())["error"]

    assert asyncio.run(run()) == (200, {"status": "ok"}, 401, 404, "not_found")
    assert sink.outputs == []


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
