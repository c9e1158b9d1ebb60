"""Who is calling a gateway: API keys from the config center, or (auth ``none``) the peer address.

Both HTTP gateways — JSON events (:mod:`streams.gateway.http`) and file uploads
(:mod:`streams.gateway.upload`) — authenticate the same way: ``Authorization: Bearer tgk_...``, a key
made with ``tangram keys create``, allowed to write the named gateway streams or uploads of one app.
The key's identity is what every limit is charged to. ``auth: none`` serves a developer's machine
without keys, each peer address its own identity with the anonymous limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from pydantic import Field
from pydantic_settings import BaseSettings

from streams.config_center import CONFIG_TOPIC, ConfigSubscriber
from streams.gateway.quota import Limits
from streams.security.keys import NAMESPACE, KeyRing
from streams.settings import StackSettings

#: The header a refused request is answered with (RFC 6750).
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="tangram"'}
#: What a request without a valid key is told.
SEND_A_KEY = "send a valid API key: `Authorization: Bearer tgk_...` (`tangram keys create`)"


class GatewayAuthSettings(BaseSettings):
    """How a gateway knows its callers; each gateway's settings class adds where it listens."""

    auth: Literal["api-key", "none"] = Field(
        "api-key", description="api-key: every request shows a key the config center holds (`tangram keys`); none: "
                               "no authentication, for a gateway on a developer's machine only.")
    config_topic: str = Field(CONFIG_TOPIC, description="The config center topic holding the keys.")
    anonymous_rate_per_s: float = Field(100.0, gt=0, description="With auth none: records/s of each peer address.")
    anonymous_burst: int = Field(1000, ge=1, description="With auth none: burst of each peer address.")
    anonymous_dlq_per_hour: int = Field(1000, ge=0, description="With auth none: dead letters/hour of each peer address.")


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the identity charged for it, its limits, and whether it may write the target."""

    identity: str
    limits: Limits
    allowed: bool = True


def caller(request: web.Request, settings: GatewayAuthSettings, keys: KeyRing | None, app: str, target: str) -> Caller | None:
    """The identity of a request for ``target`` (a stream or an upload of ``app``): its API key's (None: no
    valid key), or its peer address with auth none."""
    if keys is None:
        limits = Limits(settings.anonymous_rate_per_s, settings.anonymous_burst, settings.anonymous_dlq_per_hour)
        return Caller(f"peer:{request.remote or 'unknown'}", limits)
    header = request.headers.get("Authorization", "")
    identity = keys.authenticate(header[7:] if header.startswith("Bearer ") else None)
    if identity is None:
        return None
    k = identity.key
    return Caller(identity.name, Limits(k.rate_per_s, k.burst, k.dlq_per_hour), identity.may_write(app, target))


def follow_keys(stack: StackSettings, settings: GatewayAuthSettings, client: str) -> KeyRing | None:
    """With auth api-key, the key ring following the config center (revocations too) until its subscriber
    stops; None with auth none."""
    if settings.auth != "api-key":
        return None
    subscriber = ConfigSubscriber(stack.kafka, settings.config_topic, name=client, namespaces=[NAMESPACE]).start()
    return KeyRing(subscriber)


def stop_following_on_cleanup(app: web.Application, keys: KeyRing | None) -> None:
    """Stop following the config center when ``app`` closes."""
    if keys is None:
        return

    async def stop(_: web.Application) -> None:
        keys.subscriber.stop()

    app.on_cleanup.append(stop)
