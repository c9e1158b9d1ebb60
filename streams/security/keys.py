"""The gateways' API keys: made and revoked by the operator, kept hashed in the config center.

A key reads ``tgk_<id>_<secret>``: ``id`` (12 hex digits) names it in the config center and in
logs, ``secret`` is 32 random bytes shown once, when the key is made. What the config center
holds under ``gateway-key/<id>`` (:class:`ApiKey`) is the SHA-256 of the secret, never the
secret: with 256 random bits there is nothing to guess, so one fast hash is as safe as a slow
one and costs the gateway microseconds per request instead of milliseconds. Beside the hash:
the identity the key proves, the app and the streams it may write, its rate limit, its
dead-letter budget and its expiry.

Making, changing and revoking a key are config changes (``tangram keys create | list | revoke``),
so the config center's history is the audit trail: who, when, why, what changed. Gateways
follow the config center, so a revoked key stops working within about a second.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from streams.config_center import ConfigCenter, ConfigSubscriber

NAMESPACE = "gateway-key"
PREFIX = "tgk"
_KEY = re.compile(rf"{PREFIX}_([0-9a-f]{{12}})_([A-Za-z0-9_-]{{43}})")
_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKey(BaseModel):
    """What the config center holds for one key (``gateway-key/<id>``): never the secret itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    identity: str = Field(pattern=f"^{_IDENTITY.pattern}$", description="Who the key proves (a client, a tenant, a site).")
    app: str = Field(min_length=1, description="The app whose gateways accept it.")
    streams: list[str] = Field(min_length=1, description="The gateway streams it may write.")
    secret_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key's secret (hex).")
    rate_per_s: float = Field(100.0, gt=0, description="Readings per second this identity may send, sustained.")
    burst: int = Field(1000, ge=1, description="Readings it may send at once after a quiet period.")
    dlq_per_hour: int = Field(1000, ge=0, description="Dead letters its refused readings may cause per hour; beyond, "
                                                      "refusals are answered but not written.")
    expires_ms: int | None = Field(None, description="Epoch ms after which the key is refused; none: no expiry.")


@dataclass(frozen=True)
class NewKey:
    """A key just made: the text to hand over (shown once) and what the config center keeps."""

    key_id: str
    token: str
    record: ApiKey


def new_key(identity: str, app: str, streams: list[str], **limits: float | int | None) -> NewKey:
    """A fresh key for ``identity``, allowed to write ``streams`` of ``app``."""
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    record = ApiKey(identity=identity, app=app, streams=streams, secret_sha256=_digest(secret),
                    **{k: v for k, v in limits.items() if v is not None})
    return NewKey(key_id, f"{PREFIX}_{key_id}_{secret}", record)


def parse_token(token: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed key, else None."""
    match = _KEY.fullmatch(token.strip())
    return (match.group(1), match.group(2)) if match else None


def create(center: ConfigCenter, identity: str, app: str, streams: list[str], *, author: str | None = None,
           reason: str = "", **limits: float | int | None) -> NewKey:
    """Make a key and record it in the config center (the change is the audit record)."""
    made = new_key(identity, app, streams, **limits)
    center.set(NAMESPACE, made.key_id, made.record.model_dump(mode="json"), author,
               reason or f"API key for {identity} on {app}: {', '.join(streams)}")
    return made


def revoke(center: ConfigCenter, key_id: str, *, author: str | None = None, reason: str = "") -> None:
    """Remove a key from the config center: gateways refuse it from then on."""
    center.delete(NAMESPACE, key_id, author, reason or "revoked")


@dataclass(frozen=True)
class Identity:
    """Who a request proved to be, and what its key allows."""

    name: str
    key_id: str
    key: ApiKey

    def may_write(self, app: str, stream: str) -> bool:
        return self.key.app == app and stream in self.key.streams


class KeyRing:
    """The keys a gateway accepts, live from the config center; ``authenticate`` checks a presented key."""

    def __init__(self, subscriber: ConfigSubscriber, clock=time.time):
        self.subscriber = subscriber
        self.clock = clock

    def authenticate(self, token: str | None) -> Identity | None:
        """The identity a key proves: well formed, known, its secret's hash matching, not expired; else None."""
        parsed = parse_token(token or "")
        if parsed is None:
            return None
        key_id, secret = parsed
        raw = self.subscriber.get(NAMESPACE, key_id)
        if raw is None:
            return None
        key = ApiKey.model_validate(raw)
        if not hmac.compare_digest(_digest(secret), key.secret_sha256):
            return None
        if key.expires_ms is not None and key.expires_ms <= self.clock() * 1000:
            return None
        return Identity(key.identity, key_id, key)
