"""The gallery of documents already approved, searched by perceptual hash (degradation L2's fallback).

The seeds' switch "OCR fails → match the image hash against the historical gallery": every approved
document's perceptual hash (imagehash's DCT hash, 256 bits), type and fields go to a Redis stream
(``GalleryWriter``, a sink of the approve actions); the intake stage reads the stream incrementally
and finds each new document's nearest entry by Hamming distance. A re-scan of a document approved
before lands within a few bits; another document of the same layout lies tens of bits away.

A linear scan over packed bits: about a microsecond per entry, fine for the tens of thousands of
documents of a service hall's recent history (the stream is capped at ``max_entries``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import redis

#: The distance reported when the gallery has no entry at all.
NO_MATCH = 256


@dataclass(frozen=True)
class Match:
    doc_id: str
    distance: int
    doc_type: str
    fields: dict[str, str]


class Gallery:
    """A Redis stream of approved documents and an in-memory index of their hashes."""

    def __init__(self, client: redis.Redis, key: str, max_entries: int = 100_000):
        self.client = client
        self.key = key
        self.max_entries = max_entries
        self._last = "0-0"
        self._bits = np.zeros((0, 0), np.uint8)
        self._entries: list[tuple[str, str, dict[str, str]]] = []
        self._ids: set[str] = set()

    def add(self, doc_id: str, phash: str, doc_type: str, fields: dict[str, str]) -> None:
        self.client.xadd(self.key, {"doc_id": doc_id, "phash": phash, "doc_type": doc_type,
                                    "fields": json.dumps(fields, ensure_ascii=False)},
                         maxlen=self.max_entries, approximate=True)

    def refresh(self) -> int:
        """Read the entries added since the last call; returns how many new documents they held."""
        new = self.client.xrange(self.key, min=f"({self._last}") if self._last != "0-0" else self.client.xrange(self.key)
        if not new:
            return 0
        rows = []
        for entry_id, data in new:
            self._last = entry_id.decode()
            doc_id = data[b"doc_id"].decode()
            if doc_id in self._ids:  # written again by a re-delivered approval: indexed once
                continue
            self._ids.add(doc_id)
            self._entries.append((doc_id, data[b"doc_type"].decode(), json.loads(data[b"fields"].decode())))
            rows.append(np.frombuffer(bytes.fromhex(data[b"phash"].decode()), np.uint8))
        if not rows:
            return 0
        added = np.stack(rows)
        self._bits = added if not len(self._bits) else np.concatenate([self._bits, added])
        return len(rows)

    def nearest(self, phash: str) -> Match:
        if not self._entries:
            return Match("", NO_MATCH, "", {})
        query = np.frombuffer(bytes.fromhex(phash), np.uint8)
        distances = np.unpackbits(self._bits ^ query, axis=1).sum(axis=1)
        i = int(distances.argmin())
        doc_id, doc_type, fields = self._entries[i]
        return Match(doc_id, int(distances[i]), doc_type, fields)

    def __len__(self) -> int:
        return len(self._entries)
