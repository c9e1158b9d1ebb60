"""Basic auth for the schema registry, as Confluent's clients speak it (``basic.auth.user.info``).

Users live in a JSON file (``--users``), each with a role and a scrypt hash of its password,
never the password itself::

    {"users": {"tangram-operator": {"role": "admin", "password_hash": "scrypt$16384$8$1$<salt>$<hash>"}}}

Roles, as Confluent's registry names them:

* ``read-only``: every ``GET``, and the two ``POST`` reads: look a schema up under a subject
  (``POST /subjects/{subject}``) and test compatibility (``POST /compatibility/...``). What the
  processors, gateways and jobs need.
* ``admin``: everything, including register, delete (soft and permanent) and compatibility
  changes. What ``tangram apply`` and the operator need.

No credentials, unknown users and wrong passwords get ``401`` with a ``WWW-Authenticate``
challenge; a read-only user asking for a write gets ``403``. Both in Confluent's error body.
A password is checked with scrypt once; the checks that passed are remembered (by a digest of
user and password), so a client's steady traffic does not pay scrypt on every request while a
guesser pays it on every guess.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from aiohttp import web
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from streams.errors import StackError

log = logging.getLogger("tangram.registry.auth")

Role = Literal["admin", "read-only"]

REFUSED = Counter("tangram_registry_auth_refused_total", "Registry requests refused, by reason.", ["reason"])

#: scrypt cost: 16 MiB and ~50 ms per check here; a stolen users file costs a guesser that per guess.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
#: The reads a read-only user may make with POST: a lookup under a subject, a compatibility test.
_READ_POSTS = (re.compile(r"^/subjects/[^/]+/?$"), re.compile(r"^/compatibility/"))


def hash_password(password: str) -> str:
    """``scrypt$N$r$p$<salt>$<hash>`` (base64) of ``password``, with a fresh 16-byte salt."""
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, encoded: str) -> bool:
    """True when ``password`` hashes to ``encoded`` (constant-time comparison); False for a malformed hash."""
    try:
        scheme, n, r, p, salt, digest = encoded.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest, validate=True)
        got = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt, validate=True), n=int(n), r=int(r),
                             p=int(p), dklen=len(expected), maxmem=256 * 1024 * 1024)
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(got, expected)


class RegistryUser(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role = Field(description="admin (everything) or read-only (reads, lookups, compatibility tests).")
    password_hash: str = Field(description="scrypt$N$r$p$salt$hash, from `hash_password`.")


class RegistryUsers(BaseModel):
    """The registry's users file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    users: dict[str, RegistryUser] = Field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> RegistryUsers:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise StackError(f"cannot read the registry's users file {path}: {exc}") from exc

    def with_user(self, name: str, role: Role, password: str) -> RegistryUsers:
        if not name or ":" in name:
            raise StackError(f"registry user {name!r}: a name is non-empty and has no ':' (basic auth splits on it)")
        return RegistryUsers(users={**self.users, name: RegistryUser(role=role, password_hash=hash_password(password))})

    def save(self, path: Path) -> None:
        """Write the file readable by its owner only (it holds password hashes)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(self.model_dump(), indent=2) + "\n")


class Authenticator:
    """Checks a request's basic-auth credentials against the users; remembers the checks that passed."""

    def __init__(self, users: RegistryUsers, remembered: int = 1024):
        self.users = users
        self._passed: OrderedDict[bytes, str] = OrderedDict()  # digest of user:password → user
        self._remembered = remembered

    @staticmethod
    def _credentials(header: str | None) -> tuple[str, str] | None:
        if not header or not header.startswith("Basic "):
            return None
        try:
            name, sep, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return (name, password) if sep else None

    def remembered(self, header: str | None) -> str | None:
        """The user of credentials that passed before (no scrypt), or None."""
        credentials = self._credentials(header)
        if credentials is None:
            return None
        key = hashlib.sha256("\0".join(credentials).encode()).digest()
        name = self._passed.get(key)
        if name is not None:
            self._passed.move_to_end(key)
        return name

    def user(self, header: str | None) -> str | None:
        """The user an ``Authorization`` header proves (scrypt unless remembered), or None."""
        if (name := self.remembered(header)) is not None:
            return name
        credentials = self._credentials(header)
        if credentials is None:
            return None
        name, password = credentials
        user = self.users.users.get(name)
        if user is None or not verify_password(password, user.password_hash):
            return None
        self._passed[hashlib.sha256("\0".join(credentials).encode()).digest()] = name
        if len(self._passed) > self._remembered:
            self._passed.popitem(last=False)
        return name

    def allowed(self, name: str, method: str, path: str) -> bool:
        if self.users.users[name].role == "admin":
            return True
        if method in ("GET", "HEAD"):
            return True
        return method == "POST" and any(p.match(path) for p in _READ_POSTS)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _refuse(status: int, error_code: int, message: str, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    REFUSED.labels(reason).inc()
    return web.Response(text=json.dumps({"error_code": error_code, "message": message}), status=status,
                        content_type="application/vnd.schemaregistry.v1+json", headers=headers)


def auth_middleware(authenticator: Authenticator) -> Callable:
    """aiohttp middleware: 401 without valid credentials, 403 for a read-only user's write."""

    checks = asyncio.Semaphore(2)  # scrypt takes 16 MiB and ~50 ms: a flood of guesses queues, memory stays bounded

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization")
        name = authenticator.remembered(header)
        if name is None and header:
            async with checks:  # off the event loop: other clients' requests go on meanwhile
                name = await asyncio.to_thread(authenticator.user, header)
        if name is None:
            reason = "no_credentials" if "Authorization" not in request.headers else "bad_credentials"
            return _refuse(401, 401, "Unauthorized: basic auth credentials (basic.auth.user.info) are required",
                           reason, {"WWW-Authenticate": 'Basic realm="tangram-registry"'})
        if not authenticator.allowed(name, request.method, request.path):
            log.warning("registry: %s (read-only) refused %s %s", name, request.method, request.path)
            return _refuse(403, 40301, f"User {name} is denied operation {request.method} {request.path}: "
                                       "the read-only role may only read", "forbidden")
        return await handler(request)

    return middleware
