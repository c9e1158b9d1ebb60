"""``GET /healthz`` of the two HTTP gateways (JSON events and file uploads): what Kubernetes' probes and
docker-compose's healthcheck ask.

A gateway listens only once it has built its streams and its producer and, with API keys, caught up with the
keys the config center holds (:func:`streams.gateway.identity.follow_keys` waits for that), so an answer here
means a request with a valid key would be served. It needs no key itself and says nothing about the app.
"""

from __future__ import annotations

from aiohttp import web

#: The path both HTTP gateways answer on; the Helm chart's probes and the compose healthcheck use it.
HEALTH_PATH = "/healthz"


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def add_health(app: web.Application) -> None:
    """Answer ``GET /healthz`` on ``app``."""
    app.router.add_get(HEALTH_PATH, health)
