"""Generated secrets kept as files: the secured local stack's passwords and keys.

A :class:`SecretStore` is a folder (``<home>/security/secrets`` for ``tangram up``; a mounted
secrets volume in docker-compose) with one file per secret, ``<kind>/<name>``, readable by its
owner only. A secret is made on first use from 32 random bytes (URL-safe text, so it fits a
URL, a JAAS string and a config file unquoted) and never changes afterwards: the broker's SCRAM
credentials, the registry's users and the Redis ACL file are all derived from these files.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from pydantic import SecretStr

from streams.errors import StackError

#: Kinds and names become file names: nothing that could climb out of the folder.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def new_secret() -> str:
    """32 random bytes as URL-safe text (43 characters)."""
    return secrets.token_urlsafe(32)


class SecretStore:
    """One file per secret under ``root``: ``get`` reads it, making it first if it is missing."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, kind: str, name: str) -> Path:
        for part in (kind, name):
            if not _NAME.fullmatch(part) or ".." in part:
                raise StackError(f"secret {kind}/{name}: names are letters, digits, '.', '_' and '-'")
        return self.root / kind / name

    def get(self, kind: str, name: str) -> SecretStr:
        """The secret ``kind/name``, made (atomically, mode 0600) the first time it is asked for."""
        path = self.path(kind, name)
        try:
            return SecretStr(path.read_text().strip())
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(new_secret() + "\n")
        try:
            os.link(staging, path)  # fails if another process made it first: then theirs is the secret
        except FileExistsError:
            pass
        finally:
            staging.unlink()
        return SecretStr(path.read_text().strip())

    def exists(self, kind: str, name: str) -> bool:
        return self.path(kind, name).is_file()
