"""Processors are consumer-group members: replicas split the partitions, and a dead one's move to the survivor."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from streams.launcher import Processors
from streams.plan import apply
from streams.topology import load_topology

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def assignments(admin: AdminClient, group: str) -> list[set[int]]:
    g = admin.describe_consumer_groups([group])[group].result(timeout=10)
    return [{tp.partition for tp in m.assignment.topic_partitions} for m in g.members]


def test_two_replicas_share_the_work_and_survive_a_kill(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    text = path.read_text().replace("    kind: streams.ingest:IngestValidator\n",
                                    "    kind: streams.ingest:IngestValidator\n    replicas: 2\n")
    path.write_text(text)
    topology = load_topology(path)
    assert topology.processors["ingest"].replicas == 2
    apply(topology, stack)
    raw, out, group = f"{prefix}.raw.telemetry", f"{prefix}.ingest.telemetry", topology.group("ingest")
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})

    sent: list[str] = []
    stop = threading.Event()

    def feed() -> None:
        producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 5})
        i = 0
        while not stop.is_set():
            for d in range(12):  # 12 devices spread over the 3 partitions
                event_id = uuid.uuid4().hex
                reading = {"event_id": event_id, "device_id": f"dev-{d}", "ts": int(time.time() * 1000),
                           "temperature": 60.0, "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0}
                producer.produce(raw, json.dumps(reading).encode(), f"dev-{d}")
                sent.append(event_id)
            producer.poll(0)
            i += 1
            time.sleep(0.01)
        assert producer.flush(10) == 0

    with Processors(path, stack, names=["ingest"]) as processors:
        processors.start()
        processors.wait_joined(timeout_s=90)
        split = assignments(admin, group)
        assert len(split) == 2 and all(split), split  # both replicas hold partitions
        assert set().union(*split) == {0, 1, 2}
        feeder = threading.Thread(target=feed)
        feeder.start()
        try:
            time.sleep(3)
            processors.kill("ingest", replica=0)  # SIGKILL: its partitions must move, its batch be redone
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                now = assignments(admin, group)
                if len(now) == 1 and now[0] == {0, 1, 2}:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"partitions did not move to the survivor: {assignments(admin, group)}")
            time.sleep(2)
        finally:
            stop.set()
            feeder.join()
        consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"check-{uuid.uuid4().hex}",
                             "enable.auto.commit": False})
        consumer.assign([TopicPartition(out, p, 0) for p in range(3)])
        got: set[str] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not set(sent) <= got:
            for msg in consumer.consume(1000, 0.5):
                if not msg.error():
                    got.add(dict(msg.headers())["event_id"].decode())
        consumer.close()
    missing = set(sent) - got
    print(f"\n2 replicas, one killed: {len(sent)} sent, {len(missing)} lost")
    assert not missing
