"""HTTP uploads: ``POST /v1/uploads/{name}``, a file in ``multipart/form-data``, one Avro record out.

The seeds' step 1, ``curl -F image=@card.png -H "X-Device-ID: cam-001" http://gateway/upload``, against
a topology's ``uploads:`` (:class:`~streams.topology.UploadSpec`). The file goes into the contract's
bytes field, or into the payload store when it is over the app's ``payloads.inline_max_bytes`` (the
record then carries ``<field>_ref``); the declared headers become fields; the record is keyed by its id,
carries the ``event_id``, ``trace_id`` and ``ingest_ms`` headers, and the answer comes once the broker
acknowledged it. What the file is (format, dimensions, colour space, a duplicate) is the app's first
stage's to judge, as for files producers write to the topic themselves.

Callers authenticate as at the JSON gateway (:mod:`streams.gateway.identity`): an API key allowed to
write the upload (``tangram keys create APP --stream <upload>``); each upload is charged to the key's
rate, before its body is read.

===== ============================================================================
202   ``{"id": ..., "bytes": n, "stored": "inline" | "reference"}``: on Kafka
400   no file part, or a declared header missing
401   no API key, or one that is unknown, revoked, expired or wrong; nothing is read
403   the key may not write this upload
404   no such upload in the topology
413   the file is over the upload's ``max_bytes``
415   not ``multipart/form-data``
429   the key's rate is spent; ``Retry-After`` says when to try again
503   the broker did not acknowledge in time; retry with the same ``X-Request-ID``
===== ============================================================================

``GET /healthz`` answers 200 without a key once the gateway serves (:mod:`streams.gateway.webapp`).

Kept apart from the JSON gateway (:mod:`streams.gateway.http`): a different body, a different contract.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web
from prometheus_client import Counter, Histogram
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from streams.avro import AvroCodec, topic_codec
from streams.delivery import Output
from streams.gateway.errors import GatewayError
from streams.gateway.webapp import APP, KEYS, QUOTAS, SETTINGS, SINK, gateway_app
from streams.gateway.identity import CHALLENGE, SEND_A_KEY, GatewayAuthSettings, caller, follow_keys, \
    stop_following_on_cleanup
from streams.gateway.sink import KafkaSink
from streams.ingest import ingest_headers
from streams.payloads import PayloadStore
from streams.security.keys import KeyRing
from streams.settings import StackSettings
from streams.topology import Topology, UploadSpec, load_topology

log = logging.getLogger("tangram.gateway.upload")

UPLOADS = Counter("tangram_gateway_uploads_total", "HTTP uploads by answer.", ["upload", "status"])
UPLOAD_BYTES = Histogram("tangram_gateway_upload_bytes", "Size of accepted uploads.", ["upload"],
                         buckets=(1e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7))


class UploadGatewaySettings(GatewayAuthSettings):
    """Where the upload gateway listens and who may call it; ``TANGRAM_UPLOAD_GATEWAY_*`` overrides."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_UPLOAD_GATEWAY_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Listen address.")
    port: int = Field(8089, ge=0, le=65535, description="Listen port.")
    request_id_header: str = Field("X-Request-ID", description="A client's id for the upload (retries keep it).")
    delivery_timeout_s: float = Field(30.0, gt=0, description="How long the broker may take to acknowledge.")


@dataclass
class Upload:
    """One declared upload: its spec, the codec of its topic, the payload store."""

    name: str
    spec: UploadSpec
    codec: AvroCodec
    payloads: PayloadStore

    def record(self, data: bytes, upload_id: str, fields: dict[str, Any], now_ms: int) -> tuple[dict, str]:
        """The Avro record of one upload and where its file went (inline or reference)."""
        spec = self.spec
        file_fields = self.payloads.inline(data, spec.file_field)
        record = {spec.id_field: upload_id, spec.time_field: now_ms, **fields, **file_fields}
        return record, "inline" if file_fields[spec.file_field] is not None else "reference"


UPLOAD_SPECS = web.AppKey("uploads", dict)
#: The upload label of requests for an upload the gateway does not serve: never the caller's text.
UNKNOWN = "_unknown"


def _answer(name: str, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    UPLOADS.labels(name, str(status)).inc()
    return web.json_response(body, status=status, headers=headers)


async def _file(request: web.Request, spec: UploadSpec) -> tuple[bytes | None, str, str, dict[str, str]]:
    """The file part (at most ``max_bytes + 1`` bytes read), its name and type, and the other form fields."""
    reader = await request.multipart()
    data, filename, content_type, form = None, "", "", {}
    async for part in reader:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == spec.file_field and data is None:
            chunks, size = [], 0
            while size <= spec.max_bytes and (chunk := await part.read_chunk(65536)):
                chunks.append(chunk)
                size += len(chunk)
            data, filename, content_type = b"".join(chunks), part.filename or "", part.headers.get("Content-Type", "")
        else:
            form[part.name or ""] = (await part.text())[:1000]
    return data, filename, content_type, form


async def post_upload(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    uploads: dict[str, Upload] = request.app[UPLOAD_SPECS]
    settings = request.app[SETTINGS]
    who = caller(request, settings, request.app[KEYS], request.app[APP], name)
    if who is None:
        return _answer(name if name in uploads else UNKNOWN, 401, {"error": "unauthorized", "message": SEND_A_KEY},
                       CHALLENGE)
    if name not in uploads:
        return _answer(UNKNOWN, 404, {"error": "unknown_upload", "message": f"no such upload; uploads: {', '.join(uploads)}"})
    if not who.allowed:
        log.warning("upload %s: %s is not allowed to write it", name, who.identity)
        return _answer(name, 403, {"error": "forbidden", "message": f"this key may not write upload {name!r}"})
    if (wait := request.app[QUOTAS].admit(who.identity, who.limits, 1)) > 0:
        return _answer(name, 429, {"error": "rate_limited", "message": f"{who.identity} is over its rate"},
                       {"Retry-After": str(max(1, math.ceil(min(wait, 3600))))})
    upload = uploads[name]
    spec = upload.spec
    if request.content_type != "multipart/form-data":
        return _answer(name, 415, {"error": "content_type", "message": f"Content-Type is {request.content_type!r}; "
                                   f"send multipart/form-data with the file in part {spec.file_field!r}"})
    missing = [h for h in spec.headers if not request.headers.get(h)]
    if missing:
        return _answer(name, 400, {"error": "missing_header", "message": f"required header(s) {', '.join(missing)}"})
    data, filename, content_type, _ = await _file(request, spec)
    if data is None:
        return _answer(name, 400, {"error": "no_file", "message": f"no multipart part named {spec.file_field!r}"})
    if len(data) > spec.max_bytes:
        return _answer(name, 413, {"error": "oversize", "message": f"the file exceeds {spec.max_bytes} bytes"})
    upload_id = request.headers.get(settings.request_id_header) or uuid.uuid4().hex
    fields = {field: request.headers[header] for header, field in spec.headers.items()}
    if spec.filename_field:
        fields[spec.filename_field] = filename
    if spec.content_type_field:
        fields[spec.content_type_field] = content_type
    now_ms = int(time.time() * 1000)
    record, stored = upload.record(data, upload_id, fields, now_ms)
    headers = ingest_headers(upload_id, request.headers.get("X-Trace-Id", ""), now_ms)
    try:
        await request.app[SINK].deliver([Output(spec.topic, upload_id, upload.codec.encode(record), headers)])
    except GatewayError as exc:
        log.error("upload %s: %s", name, exc)
        return _answer(name, 503, {"error": "not_acknowledged", "message": str(exc)})
    UPLOAD_BYTES.labels(name).observe(len(data))
    return _answer(name, 202, {"id": upload_id, "bytes": len(data), "stored": stored})


def make_app(app_name: str, uploads: dict[str, Upload], sink: KafkaSink, settings: UploadGatewaySettings,
             keys: KeyRing | None) -> web.Application:
    """The aiohttp application serving ``uploads`` of app ``app_name``; ``keys`` None only with ``auth: none``."""
    largest = max(u.spec.max_bytes for u in uploads.values())  # the file, and the multipart framing around it
    app = gateway_app("upload", app_name, sink, settings, keys, client_max_size=largest + 64 * 1024)
    app[UPLOAD_SPECS] = uploads
    app.router.add_post("/v1/uploads/{name}", post_upload)
    return app


def build_app(topology: Topology, stack: StackSettings, settings: UploadGatewaySettings) -> web.Application:
    if not topology.uploads:
        raise GatewayError(f"topology {topology.app!r} declares no `uploads:`; nothing to serve")
    payloads = PayloadStore.of(topology, stack)
    uploads = {name: Upload(name, spec, topic_codec(topology, stack.registry_url, spec.topic), payloads)
               for name, spec in topology.uploads.items()}
    sink = KafkaSink(stack.kafka, f"{topology.app}.gateway.upload", name="gateway.upload",
                     delivery_timeout_s=settings.delivery_timeout_s)
    keys = follow_keys(stack, settings, f"{topology.app}.gateway.upload")
    app = make_app(topology.app, uploads, sink, settings, keys)
    stop_following_on_cleanup(app, keys)
    return app


def serve(topology_path: str | Path, stack: StackSettings, settings: UploadGatewaySettings) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = build_app(load_topology(topology_path), stack, settings)
    log.info("uploads on http://%s:%d/v1/uploads/{%s} (auth: %s)", settings.host, settings.port,
             ",".join(app[UPLOAD_SPECS]), settings.auth)
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None)
