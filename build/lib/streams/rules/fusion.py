"""Multi-model fusion: several models' predictions of one entity and window become one.

Members arrive in any order, from one topic or several. A group ``(entity, time)`` (the rule
processor's declared entity and time fields, e.g. ``(device_id, window_end)``)
is fused as soon as every active member is in, or when it has waited ``wait_ms`` (wall
clock) for the late ones — then with what it has, and the fused prediction says which
members were missing. Methods:

* ``weighted``: class probabilities averaged with the members' weights; label = argmax;
* ``max``: the member with the highest anomaly score decides;
* ``vote``: the label most members agree on (ties broken by summed weight), confidence = the
  weighted share of members that voted for it.

Members declared ``expensive`` are not waited for at degradation level L1 and above.
Fusion keeps records across micro-batches, so it tells the delivery loop the earliest
offset it still holds per partition (``committable``): nothing is committed before the
group it belongs to has been decided.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from streams.delivery import Record
from streams.rules.spec import FusionSpec


@dataclass
class Group:
    entity: str
    time: int
    opened: float  # monotonic seconds
    members: dict[str, tuple[Record, dict]] = field(default_factory=dict)  # model → (record, prediction)


@dataclass(frozen=True)
class Fused:
    """A decided group: the fused prediction, the records it came from, the members that never came."""

    prediction: dict
    records: tuple[Record, ...]
    missing: tuple[str, ...]
    timed_out: bool


class Fusion:
    """Holds open groups and fuses them when complete or past the wait."""

    def __init__(self, spec: FusionSpec, key: Callable[[dict], tuple[str, int]], clock=time.monotonic):
        self.spec = spec
        self.key = key  # the group of a prediction: its (entity, time)
        self.weights = {m.model: m.weight for m in spec.members}
        self.clock = clock
        self.groups: dict[tuple[str, int], Group] = {}
        self.decided: dict[tuple[str, int], float] = {}  # recently decided groups: late members are dropped
        self.late = 0

    def active(self, cheap_only: bool) -> tuple[str, ...]:
        return tuple(m.model for m in self.spec.members if not (cheap_only and m.expensive))

    def add(self, record: Record, prediction: dict, cheap_only: bool) -> list[Fused]:
        """Add one member's prediction; returns groups it completed (zero or one)."""
        model = prediction["model_name"]
        if model not in self.active(cheap_only):
            return []
        key = self.key(prediction)
        if key in self.decided:
            self.late += 1
            return []
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(key[0], key[1], self.clock())
        group.members.setdefault(model, (record, prediction))
        if all(m in group.members for m in self.active(cheap_only)):
            return [self._decide(key, timed_out=False, cheap_only=cheap_only)]
        return []

    def expire(self, cheap_only: bool) -> list[Fused]:
        """Groups that waited ``wait_ms`` (or are complete under the current level): decide them now."""
        now, wait = self.clock(), self.spec.wait_ms / 1000
        out = []
        for key, group in list(self.groups.items()):
            complete = all(m in group.members for m in self.active(cheap_only))
            if complete or now - group.opened >= wait:
                out.append(self._decide(key, timed_out=not complete, cheap_only=cheap_only))
        horizon = now - max(60.0, 10 * wait)
        for key, at in list(self.decided.items()):
            if at < horizon:
                del self.decided[key]
        return [f for f in out if f is not None]

    def committable(self, topic: str, partition: int) -> int | None:
        offsets = [r.offset for g in self.groups.values() for r, _ in g.members.values()
                   if r.topic == topic and r.partition == partition]
        return min(offsets) if offsets else None

    def drop(self, partitions: set[tuple[str, int]]) -> None:
        """Forget groups holding records of revoked partitions (their new owner re-reads them)."""
        for key, group in list(self.groups.items()):
            if any((r.topic, r.partition) in partitions for r, _ in group.members.values()):
                del self.groups[key]

    def _decide(self, key: tuple[str, int], timed_out: bool, cheap_only: bool) -> Fused | None:
        group = self.groups.pop(key)
        self.decided[key] = self.clock()
        missing = tuple(m for m in self.active(cheap_only) if m not in group.members)
        if len(group.members) < self.spec.min_members:
            return Fused({}, tuple(r for r, _ in group.members.values()), missing, timed_out)
        preds = [p for _, p in group.members.values()]
        return Fused(fuse(self.spec.method, preds, self.weights), tuple(r for r, _ in group.members.values()),
                     missing, timed_out)


def fuse(method: str, predictions: list[dict], weights: dict[str, float]) -> dict:
    """One prediction from several (same entity and time), by ``method``."""
    ordered = sorted(predictions, key=lambda p: p["model_name"])  # deterministic whatever the arrival order
    w = [weights.get(p["model_name"], 1.0) for p in ordered]
    total = sum(w)
    if method == "max":
        best = max(ordered, key=lambda p: p["score"])
        label, confidence, score = best["label"], best["confidence"], best["score"]
        probabilities = dict(best["probabilities"])
    elif method == "vote":
        votes: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for p, wi in zip(ordered, w):
            votes[p["label"]] += wi
            counts[p["label"]] += 1
        label = max(sorted(votes), key=lambda k: (counts[k], votes[k]))
        confidence = votes[label] / total
        score = sum(p["score"] * wi for p, wi in zip(ordered, w)) / total
        probabilities = _weighted_probabilities(ordered, w, total)
    else:  # weighted
        probabilities = _weighted_probabilities(ordered, w, total)
        label = max(sorted(probabilities), key=lambda k: probabilities[k])
        confidence = probabilities[label]
        score = sum(p["score"] * wi for p, wi in zip(ordered, w)) / total
    first = ordered[0]
    return {
        **first,
        "label": label,
        "confidence": float(confidence),
        "score": float(score),
        "probabilities": probabilities,
        "model_name": "+".join(p["model_name"] for p in ordered),
        "model_version": ",".join(f"{p['model_name']}:{p['model_version']}" for p in ordered),
        "model_versions": {p["model_name"]: p["model_version"] for p in ordered},
        "inference_ms": max(p["inference_ms"] for p in ordered),
    }


def _weighted_probabilities(ordered: list[dict], w: list[float], total: float) -> dict[str, float]:
    classes = sorted({c for p in ordered for c in p["probabilities"]})
    return {c: sum(p["probabilities"].get(c, 0.0) * wi for p, wi in zip(ordered, w)) / total for c in classes}
