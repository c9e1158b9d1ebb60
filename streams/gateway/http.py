"""HTTP ingest: ``POST /v1/streams/{stream}/events``, JSON in, Avro on Kafka out.

The body is one JSON object (a reading) or a JSON array of readings (a batch). A batch is
all-or-nothing: either every reading is written, or none is and the answer says why.

Every request carries an API key (``Authorization: Bearer tgk_...``, made with ``tangram keys
create``); the key's identity is charged for what it sends before anything is written: its
readings against its rate, the dead letters its refused readings would cause against its
dead-letter budget (``streams.gateway.quota``). ``auth: none`` (``TANGRAM_HTTP_GATEWAY_AUTH``)
serves a developer's machine without keys, each peer address its own identity.

===== ===================================================================================
200   ``{"accepted": n, "duplicates": d}`` once the broker has acknowledged every record
400   a reading breaks the contract: ``errors`` lists ``index``, ``path`` (``$[3].temperature``),
      ``field``, ``reason`` and ``message``; the refused readings are also in the DLQ
401   no API key, or one that is unknown, revoked, expired or wrong; nothing is read or written
403   the key is not allowed to write this stream
404   no such stream in the topology
413   body over ``max_body_bytes``, more than ``max_batch`` readings, or a batch larger than
      a rate limit's burst (it could never pass)
415   ``Content-Type`` is not ``application/json``
429   over the identity's rate, a topology rate limit (per identity, per device), or its
      dead-letter budget; ``Retry-After`` says when to try again; nothing of the request was written
503   the broker did not acknowledge in time; nothing is acknowledged, retry (dedup by event_id)
===== ===================================================================================

``GET /healthz`` answers 200 without a key once the gateway serves (:mod:`streams.gateway.webapp`).

Every refusal is counted (``tangram_ingest_rejected_total``, ``tangram_gateway_http_requests_total``,
``tangram_gateway_throttled_total``).
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
from pydantic_settings import SettingsConfigDict

from streams.gateway.errors import GatewayError
from streams.gateway.webapp import APP, KEYS, QUOTAS, SETTINGS, SINK, gateway_app
from streams.gateway.identity import CHALLENGE, SEND_A_KEY, Caller, GatewayAuthSettings, caller, follow_keys, \
    stop_following_on_cleanup
from streams.gateway.quota import Quotas
from streams.gateway.sink import KafkaSink
from streams.gateway.stream import IngestStream
from streams.ingest import REJECTED, Rejected
from streams.security.keys import KeyRing
from streams.settings import StackSettings
from streams.topology import Topology, load_topology

log = logging.getLogger("tangram.gateway.http")

REQUESTS = Counter("tangram_gateway_http_requests_total", "HTTP ingest requests by answer.", ["stream", "status"])
LATENCY = Histogram(
    "tangram_gateway_http_request_duration_seconds", "Request received → answered (after the broker's ack).", ["stream"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
#: The stream label of requests for a stream the gateway does not serve: never the caller's text (unbounded labels).
UNKNOWN = "_unknown"


class HttpGatewaySettings(GatewayAuthSettings):
    """Where the HTTP gateway listens and what it accepts; ``TANGRAM_HTTP_GATEWAY_*`` overrides."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_HTTP_GATEWAY_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Listen address.")
    port: int = Field(8088, ge=0, le=65535, description="Listen port.")
    max_body_bytes: int = Field(1_048_576, ge=256, description="Larger bodies are refused with 413.")
    max_batch: int = Field(1000, ge=1, description="Most readings in one request (413 above).")
    delivery_timeout_s: float = Field(30.0, gt=0, description="How long the broker may take to acknowledge.")


STREAMS = web.AppKey("streams", dict)


def _answer(stream: str, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    REQUESTS.labels(stream, str(status)).inc()
    return web.json_response(body, status=status, headers=headers)


def _refuse(stream: str, status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    REJECTED.labels(stream, reason).inc()
    return _answer(stream, status, {"error": reason, "message": message}, headers)


def _retry_after(wait_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(wait_s)))}


async def post_events(request: web.Request) -> web.Response:
    name = request.match_info["stream"]
    streams: dict[str, IngestStream] = request.app[STREAMS]
    label = name if name in streams else UNKNOWN
    who = caller(request, request.app[SETTINGS], request.app[KEYS], request.app[APP], name)
    if who is None:
        return _refuse(label, 401, "unauthorized", SEND_A_KEY, CHALLENGE)
    if name not in streams:
        return _answer(UNKNOWN, 404, {"error": "unknown_stream", "message": f"no such stream; streams: {', '.join(streams)}"})
    if not who.allowed:
        log.warning("http:%s: %s is not allowed to write this stream", name, who.identity)
        return _refuse(name, 403, "forbidden", f"this key may not write stream {name!r}")
    started = time.perf_counter()
    try:
        return await _ingest(request, streams[name], who)
    finally:
        LATENCY.labels(name).observe(time.perf_counter() - started)


async def _ingest(request: web.Request, stream: IngestStream, who: Caller) -> web.Response:
    """Size, rate and budget are checked before anything is written; then validation, then Kafka."""
    name, settings, sink, quotas = stream.name, request.app[SETTINGS], request.app[SINK], request.app[QUOTAS]
    if request.content_type != "application/json":
        return _refuse(name, 415, "content_type", f"Content-Type is {request.content_type!r}; send application/json")
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        return _refuse(name, 413, "oversize", f"body of {request.content_length} bytes exceeds {settings.max_body_bytes}")
    if (wait := quotas.exhausted(who.identity, who.limits)) > 0:  # out of tokens: not even the body is read
        return _refuse(name, 429, "rate_limited", f"{who.identity} is over its rate; retry in {wait:.2f}s",
                       _retry_after(wait))
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _refuse(name, 413, "oversize", f"body exceeds {settings.max_body_bytes} bytes")
    source = f"http:{name}"
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, a number too long, nested too deep
        reason = "not_utf8" if isinstance(exc, UnicodeDecodeError) else "bad_json"
        rejected = Rejected(reason, f"body is not {'UTF-8' if reason == 'not_utf8' else 'JSON'}: {exc}")
        if (refused := _charge(quotas, who, name, 1)) is not None:
            return refused
        REJECTED.labels(name, reason).inc()
        if (refused := _over_budget(quotas, who, name, [rejected])) is not None:
            return refused
        await sink.deliver([stream.rejected(rejected, body, source, client=who.identity)])
        return _answer(name, 400, {"error": reason, "message": str(rejected), "accepted": 0})
    readings = parsed if isinstance(parsed, list) else [parsed]
    if len(readings) > settings.max_batch:
        return _refuse(name, 413, "oversize", f"batch of {len(readings)} readings exceeds max_batch={settings.max_batch}")
    if (refused := _charge(quotas, who, name, len(readings))) is not None:
        return refused
    raw = [body] if not isinstance(parsed, list) else [json.dumps(r, separators=(",", ":")).encode() for r in readings]
    now_ms = int(time.time() * 1000)
    verdict = stream.validator.admit_batch(readings, now_ms, client=who.identity, sizes=[len(r) for r in raw])
    if verdict.rejected:
        errors = [{"index": i, "path": f"$[{i}]" + (f".{exc.field}" if exc.field else ""), "field": exc.field,
                   "reason": exc.reason, "message": str(exc)} for i, exc in verdict.rejected]
        if (refused := _over_budget(quotas, who, name, [exc for _, exc in verdict.rejected], errors)) is not None:
            return refused
        await sink.deliver([stream.rejected(exc, raw[i], source, client=who.identity, offset=i)
                            for i, exc in verdict.rejected])
        return _answer(name, 400, {"error": "invalid", "accepted": 0, "errors": errors})
    if verdict.throttled is not None:
        exc = verdict.throttled
        if exc.retry_after_s is None:
            return _answer(name, 413, {"error": "rate_limited", "message": str(exc)})
        return _answer(name, 429, {"error": "rate_limited", "message": str(exc), "retry_after_s": exc.retry_after_s},
                       _retry_after(exc.retry_after_s))
    trace_id = request.headers.get("X-Trace-Id")
    records = [record for _, record in verdict.accepted]
    try:
        await sink.deliver([stream.accepted(record, trace_id, now_ms) for record in records])
    except GatewayError as exc:
        stream.validator.forget(records)
        log.error("%s: %s", source, exc)
        return _answer(name, 503, {"error": "not_acknowledged", "message": str(exc)}, {"Retry-After": "1"})
    return _answer(name, 200, {"accepted": len(records), "duplicates": verdict.duplicates})


def _charge(quotas: Quotas, who: Caller, stream: str, readings: int) -> web.Response | None:
    """Charge ``readings`` to the caller's rate; the 429 (or 413 past its burst) when it has not got them."""
    wait = quotas.admit(who.identity, who.limits, readings)
    if wait == 0:
        return None
    REJECTED.labels(stream, "rate_limited").inc(readings)
    if math.isinf(wait):
        return _answer(stream, 413, {"error": "rate_limited", "message": f"{readings} readings exceed {who.identity}'s "
                                     f"burst of {who.limits.burst}: send smaller batches"})
    return _answer(stream, 429, {"error": "rate_limited", "message": f"{who.identity} is over its rate of "
                                 f"{who.limits.rate_per_s:g} readings/s; retry in {wait:.2f}s",
                                 "retry_after_s": wait}, _retry_after(wait))


def _over_budget(quotas: Quotas, who: Caller, stream: str, rejected: list[Rejected],
                 errors: list[dict] | None = None) -> web.Response | None:
    """Charge the dead letters to the caller's budget; the 429 (refusals answered, none written) when it is spent."""
    wait = quotas.dead_letters(who.identity, who.limits, len(rejected))
    if wait == 0:
        return None
    REJECTED.labels(stream, "dlq_budget").inc(len(rejected))
    body: dict[str, Any] = {"error": "dlq_budget", "accepted": 0,
                            "message": f"{who.identity} has spent its dead-letter budget of {who.limits.dlq_per_hour}/h: "
                                       f"these {len(rejected)} refused reading(s) were not recorded; fix them"}
    if errors:
        body["errors"] = errors
    return _answer(stream, 429, body, _retry_after(wait if not math.isinf(wait) else 3600))


def make_app(app_name: str, streams: dict[str, IngestStream], sink: KafkaSink, settings: HttpGatewaySettings,
             keys: KeyRing | None) -> web.Application:
    """The aiohttp application serving ``streams`` of app ``app_name`` (closing it closes the sink).

    ``keys`` None is only allowed with ``auth: none``.
    """
    app = gateway_app("http", app_name, sink, settings, keys, client_max_size=settings.max_body_bytes)
    app[STREAMS] = streams
    app.router.add_post("/v1/streams/{stream}/events", post_events)
    return app


def build_app(topology: Topology, names: list[str] | None, stack: StackSettings, settings: HttpGatewaySettings) -> web.Application:
    """The application for the named gateway streams of ``topology`` (all of them when ``names`` is empty).

    With ``auth: api-key`` it follows the config center for the keys (their revocations too) until closed.
    """
    names = names or list(topology.gateways)
    if not names:
        raise GatewayError(f"topology {topology.app!r} declares no `gateways:`; nothing to serve")
    streams = {n: IngestStream.from_topology(topology, n, stack) for n in names}
    sink = KafkaSink(stack.kafka, f"{topology.app}.gateway.http", name="gateway.http",
                     delivery_timeout_s=settings.delivery_timeout_s)
    keys = follow_keys(stack, settings, f"{topology.app}.gateway.http")
    app = make_app(topology.app, streams, sink, settings, keys)
    stop_following_on_cleanup(app, keys)
    return app


def serve(topology_path: str | Path, names: list[str] | None, stack: StackSettings, settings: HttpGatewaySettings) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = build_app(load_topology(topology_path), names, stack, settings)
    log.info("HTTP ingest on http://%s:%d/v1/streams/{%s}/events (auth: %s)", settings.host, settings.port,
             ",".join(app[STREAMS]), settings.auth)
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None)
