"""Payloads by reference: values too large for a Kafka record live in a content-addressed store.

Kafka refuses a record over the broker's ``message.max.bytes`` (1 MB by default), and large records
slow every consumer of a topic down. An app declares a size limit (``payloads:`` in its topology, see
:class:`~streams.topology.PayloadsSpec`); a contract holds such a value in a ``bytes`` field ``X``
(``["null", "bytes"]``) beside a string field ``X_ref``. Whoever writes the record (the upload gateway,
a producer, a stage) calls :meth:`PayloadStore.inline`: a value within the limit stays in ``X``; a
larger one is written to the store and ``X_ref`` names it. Whoever reads it calls
:meth:`PayloadStore.value`, which returns the bytes either way and checks a stored value against its
digest.

The store is a folder: the stack's home locally, a volume shared by the processors in docker-compose
and Kubernetes. References are content addresses (``sha256:<hex>``), so writing the same value twice
(a retried upload, a re-delivered batch) is idempotent, and a reference can never name other bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streams.errors import PayloadError
from streams.settings import StackSettings
from streams.topology import PayloadsSpec, Topology

#: How a reference starts: the digest algorithm of the content address.
SCHEME = "sha256:"


class PayloadStore:
    """A content-addressed folder of payloads, and the size limit above which a value goes there."""

    def __init__(self, root: Path, inline_max_bytes: int):
        self.root = Path(root)
        self.inline_max_bytes = inline_max_bytes

    @classmethod
    def of(cls, topology: Topology, stack: StackSettings) -> "PayloadStore":
        """The store the app declares (``payloads:``; the defaults of :class:`PayloadsSpec` when it declares none)."""
        spec = topology.payloads or PayloadsSpec()
        root = Path(spec.store)
        return cls(root if root.is_absolute() else stack.home / root, spec.inline_max_bytes)

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def put(self, data: bytes) -> str:
        """Store ``data`` (once: the same bytes have the same reference) and return its reference."""
        digest = hashlib.sha256(data).hexdigest()
        path = self._path(digest)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(tmp, path)  # atomic: a reader never sees half a payload
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return SCHEME + digest

    def get(self, reference: str) -> bytes:
        """The bytes a reference names; PayloadError when they are missing or differ from the digest."""
        if not reference.startswith(SCHEME) or len(reference) != len(SCHEME) + 64:
            raise PayloadError(f"{reference!r} is not a payload reference ({SCHEME}<64 hex digits>)")
        digest = reference[len(SCHEME):]
        try:
            data = self._path(digest).read_bytes()
        except OSError as exc:
            raise PayloadError(f"payload {reference} is not in the store {self.root}: {exc.strerror}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise PayloadError(f"payload {reference} in {self.root} does not match its digest: the file was altered")
        return data

    def inline(self, data: bytes, field: str) -> dict[str, Any]:
        """The record fields for ``data``: ``{field: data, field_ref: None}`` within the limit, else stored and
        ``{field: None, field_ref: reference}``."""
        if len(data) <= self.inline_max_bytes:
            return {field: data, f"{field}_ref": None}
        return {field: None, f"{field}_ref": self.put(data)}

    def value(self, record: Mapping[str, Any], field: str) -> bytes:
        """The bytes of ``field`` of a decoded record, inline or by reference (PayloadError when it has neither)."""
        data = record.get(field)
        if data is not None:
            return data
        reference = record.get(f"{field}_ref")
        if not reference:
            raise PayloadError(f"the record carries neither {field!r} nor {field + '_ref'!r}")
        return self.get(reference)
