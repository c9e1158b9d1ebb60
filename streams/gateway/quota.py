"""Per-identity quotas of the gateways: readings per second, and dead letters per hour.

Every request or message is charged to the identity that sent it (an API key's identity, an
MQTT device's user, or, on an unauthenticated developer gateway, the peer address) *before*
anything is written: the readings it carries against the identity's rate, and the dead letters
its refused readings would cause against the identity's dead-letter budget. An identity over its
rate is told to retry later (nothing written); one over its budget gets its refusals answered
but not written, so no client can fill a DLQ. Both are counted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client import Counter

from streams.ingest import TokenBuckets, TokenBucketSettings

THROTTLED = Counter("tangram_gateway_throttled_total",
                    "Requests or messages refused before any write, by gateway and what ran out (rate, dlq_budget).",
                    ["gateway", "quota"])


@dataclass(frozen=True)
class Limits:
    """One identity's limits."""

    rate_per_s: float
    burst: int
    dlq_per_hour: int


class Quotas:
    """Token buckets per identity (the least recently seen forgotten past ``max_identities``)."""

    def __init__(self, gateway: str, max_identities: int = 100_000, clock=time.monotonic):
        self.gateway = gateway
        self.max_identities = max_identities
        self.clock = clock
        self._buckets: OrderedDict[tuple[str, Limits], tuple[TokenBuckets, TokenBuckets | None]] = OrderedDict()

    def _of(self, identity: str, limits: Limits) -> tuple[TokenBuckets, TokenBuckets | None]:
        key = (identity, limits)  # changed limits (a key updated) start fresh buckets
        buckets = self._buckets.get(key)
        if buckets is None:
            rate = TokenBuckets(TokenBucketSettings(rate_per_s=limits.rate_per_s, burst=limits.burst), 1)
            dlq = (TokenBuckets(TokenBucketSettings(rate_per_s=limits.dlq_per_hour / 3600, burst=limits.dlq_per_hour), 1)
                   if limits.dlq_per_hour else None)
            buckets = self._buckets[key] = (rate, dlq)
            if len(self._buckets) > self.max_identities:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return buckets

    def _charge(self, bucket: TokenBuckets | None, quota: str, identity: str, n: int, take: bool = True) -> float:
        """0.0 when ``n`` tokens are there (taken unless ``take`` is off), else the seconds to wait; counted."""
        wait = float("inf") if bucket is None else bucket.shortfall(identity, n, self.clock())
        if wait > 0:
            THROTTLED.labels(self.gateway, quota).inc()
            return wait
        if take:
            bucket.take(identity, n)  # type: ignore[union-attr]  # not None when there is no wait
        return 0.0

    def exhausted(self, identity: str, limits: Limits) -> float:
        """Seconds until the identity has a token again (0.0: it has one now); takes nothing."""
        return self._charge(self._of(identity, limits)[0], "rate", identity, 1, take=False)

    def admit(self, identity: str, limits: Limits, readings: int) -> float:
        """Charge ``readings`` to the identity's rate: 0.0 when taken, else the seconds to wait (inf: over the burst)."""
        return self._charge(self._of(identity, limits)[0], "rate", identity, readings)

    def dead_letters(self, identity: str, limits: Limits, count: int) -> float:
        """Charge ``count`` dead letters to the identity's budget (none: no budget at all): 0.0, else the wait."""
        return self._charge(self._of(identity, limits)[1], "dlq_budget", identity, count)
