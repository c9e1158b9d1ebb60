"""``GET /healthz`` of the two HTTP gateways (JSON events and file uploads): what Kubernetes' probes and
docker-compose's healthcheck ask; and their answer to a request no route takes (a JSON error, as for every
other refusal: a client parses one kind of body).

A gateway listens only once it has built its streams and its producer and, with API keys, caught up with the
keys the config center holds (:func:`streams.gateway.identity.follow_keys` waits for that), so an answer here
means a request with a valid key would be served. It needs no key itself and says nothing about the app.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

#: The path both HTTP gateways answer on; the Helm chart's probes and the compose healthcheck use it.
HEALTH_PATH = "/healthz"


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def add_health(app: web.Application) -> None:
    """Answer ``GET /healthz`` on ``app``."""
    app.router.add_get(HEALTH_PATH, health)


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
