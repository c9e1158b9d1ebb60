"""Multi-model fusion: weighted, max, vote; a missing member after the bounded wait."""

import pytest

from streams.delivery import Record
from streams.rules.fusion import Fusion, fuse
from streams.rules.spec import FusionSpec


#: The rule processor groups predictions by its declared entity and time fields.
KEY = lambda p: (p["device_id"], p["window_end"])  # noqa: E731


def pred(model, label, score, version="1", device="dev-1", end=5000, p=None):
    probs = p or {"healthy": 1 - score, label if label != "healthy" else "bearing_wear": score}
    return {"event_id": f"{model}:{device}:{end}", "device_id": device, "window_start": end - 5000, "window_end": end,
            "score": score, "label": label, "confidence": max(probs.values()), "probabilities": probs,
            "model_name": model, "model_version": version, "inference_ms": 3.0, "trace_id": "t"}


def rec(offset, topic="p", partition=0):
    return Record(topic, partition, offset, b"dev-1", b"", {}, 0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


WEIGHTS = {"a": 3.0, "b": 1.0}


def test_weighted_fusion_averages_probabilities_with_weights():
    out = fuse("weighted", [pred("a", "bearing_wear", 0.9), pred("b", "healthy", 0.1)], WEIGHTS)
    assert out["label"] == "bearing_wear" and out["score"] == pytest.approx((0.9 * 3 + 0.1) / 4)
    assert out["model_versions"] == {"a": "1", "b": "1"} and out["model_name"] == "a+b"


def test_max_fusion_takes_the_most_anomalous_member():
    out = fuse("max", [pred("a", "healthy", 0.2), pred("b", "overheating", 0.8)], WEIGHTS)
    assert out["label"] == "overheating" and out["score"] == 0.8


def test_vote_fusion_takes_the_majority_label():
    preds = [pred("a", "healthy", 0.2), pred("b", "bearing_wear", 0.9), pred("c", "bearing_wear", 0.7)]
    out = fuse("vote", preds, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert out["label"] == "bearing_wear" and out["confidence"] == pytest.approx(2 / 3)


def test_fusion_is_independent_of_arrival_order():
    a, b = pred("a", "bearing_wear", 0.9), pred("b", "healthy", 0.1)
    assert fuse("weighted", [a, b], WEIGHTS) == fuse("weighted", [b, a], WEIGHTS)


def spec(**kw):
    return FusionSpec.model_validate({"members": [{"model": "a", "weight": 3}, {"model": "b", "expensive": True}],
                                      "wait_ms": 2000, **kw})


def test_complete_group_is_fused_at_once_and_holds_back_the_commit_until_then():
    fusion = Fusion(spec(), KEY, Clock())
    assert fusion.add(rec(7), pred("a", "bearing_wear", 0.9), cheap_only=False) == []
    assert fusion.committable("p", 0) == 7
    [done] = fusion.add(rec(8), pred("b", "bearing_wear", 0.8), cheap_only=False)
    assert done.missing == () and not done.timed_out and fusion.committable("p", 0) is None


def test_a_missing_member_is_fused_without_it_after_the_wait_and_says_so():
    clock = Clock()
    fusion = Fusion(spec(), KEY, clock)
    fusion.add(rec(1), pred("a", "bearing_wear", 0.9), cheap_only=False)
    clock.t = 1.9
    assert fusion.expire(cheap_only=False) == []
    clock.t = 2.0
    [done] = fusion.expire(cheap_only=False)
    assert done.missing == ("b",) and done.timed_out and done.prediction["model_versions"] == {"a": "1"}
    # the late member is dropped: the window was decided
    assert fusion.add(rec(2), pred("b", "bearing_wear", 0.8), cheap_only=False) == [] and fusion.late == 1


def test_at_l1_expensive_members_are_not_waited_for():
    fusion = Fusion(spec(), KEY, Clock())
    [done] = fusion.add(rec(1), pred("a", "bearing_wear", 0.9), cheap_only=True)
    assert done.missing == () and fusion.add(rec(2), pred("b", "healthy", 0.1, end=10000), cheap_only=True) == []


def test_too_few_members_is_no_decision():
    clock = Clock()
    fusion = Fusion(spec(min_members=2), KEY, clock)
    fusion.add(rec(1), pred("a", "bearing_wear", 0.9), cheap_only=False)
    clock.t = 5
    [done] = fusion.expire(cheap_only=False)
    assert done.prediction == {} and done.missing == ("b",)


def test_members_must_be_distinct():
    with pytest.raises(ValueError, match="distinct"):
        FusionSpec.model_validate({"members": [{"model": "a"}, {"model": "a"}]})
