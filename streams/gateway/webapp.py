"""The aiohttp application both HTTP gateways (JSON events and file uploads) start from: the state every
handler reads (the sink, the settings, the app's name, the key ring, the quotas), ``GET /healthz`` (what
Kubernetes' probes and docker-compose's healthcheck ask), the answer to a request no route takes (a JSON
error, as for every other refusal: a client parses one kind of body), and the sink closed with the app.

A gateway listens only once it has built its streams and its producer and, with API keys, caught up with the
keys the config center holds (:func:`streams.gateway.identity.follow_keys` waits for that), so an answer here
means a request with a valid key would be served. It needs no key itself and says nothing about the app.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from streams.gateway.errors import GatewayError
from streams.gateway.quota import Quotas
from streams.gateway.sink import KafkaSink
from streams.security.keys import KeyRing

#: The path both HTTP gateways answer on; the Helm chart's probes and the compose healthcheck use it.
HEALTH_PATH = "/healthz"

SINK = web.AppKey("sink", KafkaSink)
SETTINGS = web.AppKey("settings", object)  # the gateway's own settings (auth, limits)
APP = web.AppKey("app", str)
KEYS = web.AppKey("keys", object)  # a KeyRing, or None with auth none
QUOTAS = web.AppKey("quotas", Quotas)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (no such path, a method not allowed) with a JSON body like the gateways' own."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": exc.reason.lower().replace(" ", "_"),
                                  "message": f"{request.method} {request.path}: {exc.reason}"},
                                 status=exc.status, headers={k: v for k, v in exc.headers.items()
                                                             if k.lower() not in ("content-type", "content-length")})


def gateway_app(gateway: str, app_name: str, sink: KafkaSink, settings, keys: KeyRing | None,
                client_max_size: int) -> web.Application:
    """The application of gateway ``gateway`` (``http``, ``upload``) for app ``app_name``, before its routes;
    ``keys`` None only with ``auth: none``. Closing it closes ``sink``."""
    if keys is None and settings.auth != "none":
        raise GatewayError(f"the {gateway} gateway needs its key ring (auth: api-key), or auth: none on purpose")
    app = web.Application(client_max_size=client_max_size, middlewares=[json_errors])
    app[SINK] = sink
    app[SETTINGS] = settings
    app[APP] = app_name
    app[KEYS] = keys
    app[QUOTAS] = Quotas(gateway)
    app.router.add_get(HEALTH_PATH, health)

    async def close_sink(_: web.Application) -> None:
        sink.close()

    app.on_cleanup.append(close_sink)
    return app
