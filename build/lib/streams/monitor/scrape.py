"""Reading a processor's ``/metrics``: Prometheus text format, parsed by prometheus_client's own parser.

``scrape(url)`` returns a :class:`Scrape`: every sample by name and labels, with helpers for
the sums and histogram quantiles a status view needs (``histogram_quantile`` interpolates
within the bucket as Prometheus's function of the same name does).
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from streams.errors import StackError


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Scrape:
    """The samples of one scrape."""

    samples: tuple[Sample, ...]
    families: frozenset[str]

    def select(self, name: str, **labels: str) -> list[Sample]:
        return [s for s in self.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        """Sum of every sample of ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(s.value for s in self.select(name, **labels))

    def histogram_quantile(self, name: str, q: float, **labels: str) -> float | None:
        """The ``q`` quantile of histogram ``name`` (buckets summed over other labels); None when empty."""
        buckets: dict[float, float] = {}
        for s in self.select(f"{name}_bucket", **labels):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
        return quantile_of_buckets(buckets, q)


def quantile_of_buckets(buckets: Mapping[float, float], q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative bucket counts keyed by upper bound."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # in the +Inf bucket: the highest finite bound, as Prometheus answers
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-1]


def parse(text: str) -> Scrape:
    """Parse Prometheus text exposition format."""
    samples, families = [], set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    return Scrape(tuple(samples), frozenset(families))


def scrape(url: str, timeout_s: float = 2.0) -> Scrape:
    """GET ``url`` (a ``/metrics`` endpoint) and parse it; StackError when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return parse(response.read().decode("utf-8"))
    except OSError as exc:
        raise StackError(f"metrics endpoint {url} did not answer within {timeout_s}s: {exc}") from exc
