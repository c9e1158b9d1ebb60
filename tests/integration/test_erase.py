"""`tangram erase`: an entity's online features gone, its compacted records tombstoned, the erasure recorded."""

from __future__ import annotations

import uuid

import pytest
import redis
from confluent_kafka import Consumer, Producer, TopicPartition

from streams.features.engine import online_layout
from streams.plan import apply
from streams.security.erase import ErasureError, compacted_topics, entity_digest, erase, erasures
from streams.topology import load_topology

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def test_erase_removes_the_entity_and_records_who_did_it(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    topology = load_topology(path)
    apply(topology, stack)
    layout = online_layout(topology)
    store = redis.Redis.from_url(stack.redis_url)
    gone, kept = f"dev-{uuid.uuid4().hex[:6]}", f"dev-{uuid.uuid4().hex[:6]}"
    for entity in (gone, kept):
        store.hset(layout.key(entity), "f", "1")
    labels, devices = f"{prefix}.sim.labels", f"{prefix}.devices"
    assert sorted(compacted_topics(topology)) == sorted([labels, devices])  # the truth and the device register
    producer = Producer(stack.kafka.config({"enable.idempotence": True}))
    for entity in (gone, kept):
        producer.produce(labels, b'{"fault": "bearing_wear"}', entity.encode())
    assert producer.flush(30) == 0

    done = erase(topology, gone, stack, actor="dpo@example.com", reason="GDPR request #1234")

    assert done.redis_keys == 1 and not store.exists(layout.key(gone)) and store.exists(layout.key(kept))
    assert done.tombstones == {labels: 1, devices: 1}  # every compacted topic keyed by the entity
    consumer = Consumer(stack.kafka.config({"group.id": f"t-{uuid.uuid4().hex}", "enable.auto.commit": False}))
    consumer.assign([TopicPartition(labels, 0, 0)])
    latest: dict[bytes, bytes | None] = {}
    while len(latest) < 2 or latest.get(gone.encode(), b"") is not None:
        msgs = consumer.consume(100, 5)
        assert msgs, f"the tombstone of {gone} never arrived on {labels}: {latest}"
        latest.update({m.key(): m.value() for m in msgs if not m.error()})
    consumer.close()
    assert latest[gone.encode()] is None and latest[kept.encode()] is not None
    recorded = [e for e in erasures(stack, topology.app) if e["id"] == done.id]
    assert recorded and recorded[0]["entity_sha256"] == entity_digest(topology.app, gone)
    assert recorded[0]["actor"] == "dpo@example.com" and recorded[0]["reason"] == "GDPR request #1234"
    assert gone not in str(recorded[0])  # the record proves the erasure without keeping the identifier
    with pytest.raises(ErasureError):
        erase(topology, "bad\nentity", stack)
