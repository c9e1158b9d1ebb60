"""``tangram erase APP ENTITY``: an entity's data out of the online store and the compacted topics, recorded.

What an operator runs on a data-subject erasure request:

1. the entity's online features are deleted from Redis: its key in Feast's layout for every
   feature set the app's feature processors write;
2. a tombstone (the entity as key, no value) goes to every compacted topic of the app: the
   log cleaner then removes every earlier record of that key (tables, labels, any state kept by
   entity);
3. the erasure is recorded on the compacted topic ``_tangram.erasures``: who, when, why, what was
   removed, and the entity only as a SHA-256 digest, so the record proves the erasure without
   keeping the identifier it was asked to forget.

What it cannot do, and the operator must (docs/security.md): records in topics that are not
compacted (ingest, features, predictions, actions, DLQs) leave only when their retention expires,
and copies outside Kafka and Redis (backups, replay folders, exports) are the operator's.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, Producer

from streams.errors import TangramError
from streams.settings import StackSettings
from streams.statelog import LogRecord, StateTopic, default_actor
from streams.topology import Kind, Topology

ERASURES_TOPIC = "_tangram.erasures"


class ErasureError(TangramError):
    """An erasure could not be completed; what was done so far is in the message, and running it again is safe."""


def check_entity(entity: str) -> str:
    """An entity key as the runtime writes them: non-empty UTF-8 text, no control characters, at most 256 characters."""
    if not entity or len(entity) > 256 or any(ord(c) < 32 or ord(c) == 127 for c in entity):
        raise ErasureError(f"entity {entity[:40]!r}: give the entity key as the app writes it (1-256 printable characters)")
    return entity


def entity_digest(app: str, entity: str) -> str:
    """What the erasure record keeps instead of the entity: SHA-256 of ``app:entity``."""
    return hashlib.sha256(f"{app}:{entity}".encode()).hexdigest()


@dataclass
class Erasure:
    """What one erasure did."""

    id: str
    app: str
    entity_sha256: str
    actor: str
    reason: str
    at_ms: int
    redis_keys: int = 0  # online-store keys deleted
    tombstones: dict[str, int] = field(default_factory=dict)  # compacted topic → tombstones written

    def record(self) -> LogRecord:
        return LogRecord({"kind": "erasure", "id": self.id}, {
            "app": self.app, "entity_sha256": self.entity_sha256, "actor": self.actor, "reason": self.reason,
            "at_ms": self.at_ms, "redis_keys": self.redis_keys, "tombstones": self.tombstones})


def _online_keys(topology: Topology, entity: str) -> list[bytes]:
    """The entity's Redis keys: one per features processor of the app (Feast's layout of its feature set)."""
    from streams.features.engine import online_layout

    return [online_layout(topology, name).key(entity) for name in topology.processors_of(Kind.FEATURES)]


def compacted_topics(topology: Topology) -> list[str]:
    return [name for name, spec in topology.topics.items() if "compact" in (spec.cleanup_policy or "")]


def erase(topology: Topology, entity: str, stack: StackSettings, *, actor: str | None = None, reason: str = "",
          timeout_s: float = 30.0) -> Erasure:
    """Erase ``entity`` of ``topology``'s app (see the module's docstring); returns the recorded erasure."""
    import redis

    check_entity(entity)
    done = Erasure(uuid.uuid4().hex, topology.app, entity_digest(topology.app, entity), actor or default_actor(),
                   reason, int(time.time() * 1000))
    keys = _online_keys(topology, entity)
    if keys:
        client = redis.Redis.from_url(stack.redis_url, socket_timeout=5, socket_connect_timeout=5)
        try:
            done.redis_keys = int(client.delete(*keys))
        except redis.RedisError as exc:
            raise ErasureError(f"could not delete the online features of the entity in Redis: {exc}; nothing else "
                               "was erased yet, run it again") from exc
        finally:
            client.close()
    topics = compacted_topics(topology)
    if topics:
        failures: list[str] = []
        producer = Producer(stack.kafka.config({"enable.idempotence": True, "acks": "all",
                                                "message.timeout.ms": int(timeout_s * 1000)}))

        def settled(err: KafkaError | None, msg) -> None:
            if err is not None:
                failures.append(f"{msg.topic()}: {err.str()}")
            else:
                done.tombstones[msg.topic()] = done.tombstones.get(msg.topic(), 0) + 1

        for topic in topics:
            producer.produce(topic, None, entity.encode(), on_delivery=settled)
        left = producer.flush(timeout_s)
        if failures or left:
            raise ErasureError(f"online features deleted ({done.redis_keys} key(s)), but tombstones were not all "
                               f"written: {failures or f'{left} unacknowledged'}; run it again")
    log = StateTopic(stack.kafka, ERASURES_TOPIC, timeout_s)
    log.ensure()
    log.append([done.record()])
    log.close()
    return done


def erasures(stack: StackSettings, app: str | None = None) -> list[dict]:
    """The recorded erasures (of ``app``), oldest first."""
    log = StateTopic(stack.kafka, ERASURES_TOPIC)
    log.ensure()
    return [{"id": r.key["id"], **r.value} for r in log.replay()
            if r.key.get("kind") == "erasure" and r.value is not None and (app is None or r.value.get("app") == app)]
