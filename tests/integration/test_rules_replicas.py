"""The rule processor with two replicas on the real stack: co-partitioned inputs (issue #21).

The rules keep per-entity state across their two inputs (predictions and feature windows: the
degradation signals count windows whose prediction never came; one decision per entity window). With
each topic's partitions balanced on their own, a replica could hold ``predictions[0]`` and
``device_window[1]``: it would see windows whose predictions another replica reads, count them missing,
and fall back to deciding without the model. The delivery loop gives a processor reading several topics
the ``range`` assignor (Kafka Streams' co-partitioning): each replica owns the same partition numbers of
both topics.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from rules_helpers import Actions, Feed, InProcess, prediction, rules_topology, window

pytestmark = pytest.mark.integration

RULES = [{"name": "bearing_wear", "when": "label == 'bearing_wear' and confidence >= 0.8", "action": "maintenance"}]
DEVICES = 40


def _members(stack, group: str) -> list[dict[str, set[int]]]:
    """Each member's partitions of the group, by topic (without its namespace). Asked of the broker: a
    consumer's own ``assignment()`` must not be called from another thread than its loop's."""
    admin = AdminClient(stack.kafka.config())
    try:
        described = admin.describe_consumer_groups([group])[group].result(timeout=10)
    except KafkaException:
        return []
    if described.state.name != "STABLE":
        return []
    owned = []
    for member in described.members:
        tps: dict[str, set[int]] = {}
        for tp in member.assignment.topic_partitions:
            tps.setdefault(tp.topic.split(".", 1)[1], set()).add(tp.partition)
        owned.append(tps)
    return owned


def test_two_replicas_own_the_same_partitions_of_both_inputs_and_decide_every_window_with_the_model(stack, tmp_path):
    topology, _, prefix = rules_topology(tmp_path, stack, rules=RULES)
    inputs = topology.processors["rules"].inputs
    partitions = topology.partitions(inputs[0])
    assert partitions == topology.partitions(inputs[1]) == 3
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    with InProcess(topology, "rules", stack) as a, InProcess(topology, "rules", stack) as b:
        deadline, owned = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            owned = _members(stack, topology.group("rules"))
            if len(owned) == 2 and all(owned) and sum(len(p) for o in owned for p in o.values()) == 2 * partitions:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the two replicas did not share the {2 * partitions} partitions: {owned}")
        for o in owned:  # the same partition numbers of both topics, per replica
            (first, second) = (o.get("predictions.anomaly", set()), o.get("features.device_window", set()))
            assert first == second and first, owned
        assert owned[0]["predictions.anomaly"].isdisjoint(owned[1]["predictions.anomaly"])
        assert a.runner.config.strategy(a.processor) == "range"

        end = int(time.time() * 1000) // 5000 * 5000
        devices = [f"rep-{i:03d}" for i in range(DEVICES)]
        feed.windows([window(d, end) for d in devices])
        feed.predict([prediction(d, end) for d in devices])
        seen = actions.until(lambda s: len(s) >= DEVICES, 60)
        time.sleep(2)
        seen = actions.settle()
    actions.close()
    assert sorted(x["device_id"] for x in seen) == devices  # each once
    assert {x["degradation_level"] for x in seen} == {"L0"} and {x["rule"] for x in seen} == {"bearing_wear"}
    assert a.processor.level == "L0" and b.processor.level == "L0"
