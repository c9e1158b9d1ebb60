"""HTTP ingest: ``POST /v1/streams/{stream}/events``, JSON in, Avro on Kafka out.

The body is one JSON object (a reading) or a JSON array of readings (a batch). A batch is
all-or-nothing: either every reading is written, or none is and the answer says why.

===== ===================================================================================
200   ``{"accepted": n, "duplicates": d}`` once the broker has acknowledged every record
400   a reading breaks the contract: ``errors`` lists ``index``, ``path`` (``$[3].temperature``),
      ``field``, ``reason`` and ``message``; the refused readings are also in the DLQ
404   no such stream in the topology
413   body over ``max_body_bytes``, more than ``max_batch`` readings, or a batch larger than
      a rate limit's burst (it could never pass)
415   ``Content-Type`` is not ``application/json``
429   over a rate limit (per client: ``X-Client-Id`` or the peer address; per device);
      ``Retry-After`` says when to try again; nothing of the request was written
503   the broker did not acknowledge in time; nothing is acknowledged, retry (dedup by event_id)
===== ===================================================================================

Every refusal is counted (``tangram_ingest_rejected_total``, ``tangram_gateway_http_requests_total``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.gateway.errors import GatewayError
from streams.gateway.sink import KafkaSink
from streams.gateway.stream import IngestStream
from streams.ingest import REJECTED, Rejected
from streams.settings import StackSettings
from streams.topology import Topology, load_topology

log = logging.getLogger("tangram.gateway.http")

REQUESTS = Counter("tangram_gateway_http_requests_total", "HTTP ingest requests by answer.", ["stream", "status"])
LATENCY = Histogram(
    "tangram_gateway_http_request_duration_seconds", "Request received → answered (after the broker's ack).", ["stream"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


class HttpGatewaySettings(BaseSettings):
    """Where the HTTP gateway listens and what it accepts; ``TANGRAM_HTTP_GATEWAY_*`` overrides."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_HTTP_GATEWAY_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Listen address.")
    port: int = Field(8088, ge=0, le=65535, description="Listen port.")
    max_body_bytes: int = Field(1_048_576, ge=256, description="Larger bodies are refused with 413.")
    max_batch: int = Field(1000, ge=1, description="Most readings in one request (413 above).")
    client_header: str = Field("X-Client-Id", description="Header naming the client for per-client rate limits.")
    delivery_timeout_s: float = Field(30.0, gt=0, description="How long the broker may take to acknowledge.")


STREAMS = web.AppKey("streams", dict)
SINK = web.AppKey("sink", KafkaSink)
SETTINGS = web.AppKey("settings", HttpGatewaySettings)


def _answer(stream: str, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    REQUESTS.labels(stream, str(status)).inc()
    return web.json_response(body, status=status, headers=headers)


def _refuse(stream: str, status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    REJECTED.labels(stream, reason).inc()
    return _answer(stream, status, {"error": reason, "message": message}, headers)


async def post_events(request: web.Request) -> web.Response:
    name = request.match_info["stream"]
    streams: dict[str, IngestStream] = request.app[STREAMS]
    settings = request.app[SETTINGS]
    if name not in streams:
        return _answer(name, 404, {"error": "unknown_stream", "message": f"no stream {name!r}; streams: {', '.join(streams)}"})
    stream = streams[name]
    started = time.perf_counter()
    try:
        return await _ingest(request, stream, settings, request.app[SINK])
    finally:
        LATENCY.labels(name).observe(time.perf_counter() - started)


async def _ingest(request: web.Request, stream: IngestStream, settings: HttpGatewaySettings, sink: KafkaSink) -> web.Response:
    name = stream.name
    if request.content_type != "application/json":
        return _refuse(name, 415, "content_type", f"Content-Type is {request.content_type!r}; send application/json")
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        return _refuse(name, 413, "oversize", f"body of {request.content_length} bytes exceeds {settings.max_body_bytes}")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _refuse(name, 413, "oversize", f"body exceeds {settings.max_body_bytes} bytes")
    client = request.headers.get(settings.client_header) or request.remote or "unknown"
    source = f"http:{name}"
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = "not_utf8" if isinstance(exc, UnicodeDecodeError) else "bad_json"
        rejected = Rejected(reason, f"body is not {'UTF-8' if reason == 'not_utf8' else 'JSON'}: {exc}")
        REJECTED.labels(name, reason).inc()
        await sink.deliver([stream.rejected(rejected, body, source, client=client)])
        return _answer(name, 400, {"error": reason, "message": str(rejected), "accepted": 0})
    readings = parsed if isinstance(parsed, list) else [parsed]
    if len(readings) > settings.max_batch:
        return _refuse(name, 413, "oversize", f"batch of {len(readings)} readings exceeds max_batch={settings.max_batch}")
    raw = [body] if not isinstance(parsed, list) else [json.dumps(r, separators=(",", ":")).encode() for r in readings]
    now_ms = int(time.time() * 1000)
    verdict = stream.validator.admit_batch(readings, now_ms, client=client, sizes=[len(r) for r in raw])
    if verdict.rejected:
        await sink.deliver([stream.rejected(exc, raw[i], source, client=client, offset=i) for i, exc in verdict.rejected])
        errors = [{"index": i, "path": f"$[{i}]" + (f".{exc.field}" if exc.field else ""), "field": exc.field,
                   "reason": exc.reason, "message": str(exc)} for i, exc in verdict.rejected]
        return _answer(name, 400, {"error": "invalid", "accepted": 0, "errors": errors})
    if verdict.throttled is not None:
        exc = verdict.throttled
        if exc.retry_after_s is None:
            return _answer(name, 413, {"error": "rate_limited", "message": str(exc)})
        retry = max(1, math.ceil(exc.retry_after_s))
        return _answer(name, 429, {"error": "rate_limited", "message": str(exc), "retry_after_s": exc.retry_after_s},
                       {"Retry-After": str(retry)})
    trace_id = request.headers.get("X-Trace-Id")
    records = [record for _, record in verdict.accepted]
    try:
        await sink.deliver([stream.accepted(record, trace_id, now_ms) for record in records])
    except GatewayError as exc:
        stream.validator.forget(records)
        log.error("%s: %s", source, exc)
        return _answer(name, 503, {"error": "not_acknowledged", "message": str(exc)}, {"Retry-After": "1"})
    return _answer(name, 200, {"accepted": len(records), "duplicates": verdict.duplicates})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "streams": sorted(request.app[STREAMS])})


def make_app(streams: dict[str, IngestStream], sink: KafkaSink, settings: HttpGatewaySettings) -> web.Application:
    """The aiohttp application serving ``streams`` (closing it closes the sink)."""
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[STREAMS] = streams
    app[SINK] = sink
    app[SETTINGS] = settings
    app.router.add_post("/v1/streams/{stream}/events", post_events)
    app.router.add_get("/healthz", health)

    async def close_sink(_: web.Application) -> None:
        sink.close()

    app.on_cleanup.append(close_sink)
    return app


def build_app(topology: Topology, names: list[str] | None, stack: StackSettings, settings: HttpGatewaySettings) -> web.Application:
    """The application for the named gateway streams of ``topology`` (all of them when ``names`` is empty)."""
    names = names or list(topology.gateways)
    if not names:
        raise GatewayError(f"topology {topology.app!r} declares no `gateways:`; nothing to serve")
    streams = {n: IngestStream.from_topology(topology, n, stack) for n in names}
    sink = KafkaSink(stack.bootstrap_servers, f"{topology.app}.gateway.http", name="gateway.http",
                     delivery_timeout_s=settings.delivery_timeout_s)
    return make_app(streams, sink, settings)


def serve(topology_path: str | Path, names: list[str] | None, stack: StackSettings, settings: HttpGatewaySettings) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = build_app(load_topology(topology_path), names, stack, settings)
    log.info("HTTP ingest on http://%s:%d/v1/streams/{%s}/events", settings.host, settings.port, ",".join(app[STREAMS]))
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None)
