"""State kept on a compacted Kafka topic: append, replay, and follow live.

The model registry (``_tangram.models``) and the config center (``_tangram.config``) keep
their whole state as JSON records on a one-partition compacted topic, like the schema
registry does with ``_schemas`` (``streams/registry/log.py``). Each record has a JSON key and
a JSON value; state is a pure fold of the records in offset order, so a fresh reader that
replays the topic rebuilds exactly the state every live reader holds.

* :class:`StateTopic` creates the topic, replays it up to its end, and appends records with
  an idempotent ``acks=all`` producer, returning the offsets the broker acknowledged.
* :class:`TopicFollower` tails the topic from the beginning in a background thread and hands
  every record to a callback: this is the live push that processors embed (config
  subscriber, model registry watcher). librdkafka reconnects by itself when the broker
  restarts, and the follower resumes from its position.

Every call has a deadline.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from streams.errors import StateLogError
from streams.security.kafka import KafkaConnection

#: Errors of a partition whose leader is being elected: asked again until the deadline.
_LEADER_MOVING = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                            KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TRANSPORT})

log = logging.getLogger("tangram.statelog")


@dataclass(frozen=True)
class LogRecord:
    """One record of a state topic: JSON key, JSON value (``None`` = tombstone), offset, time."""

    key: dict[str, Any]
    value: dict[str, Any] | None
    offset: int = -1
    timestamp_ms: int = 0

    def key_bytes(self) -> bytes:
        return json.dumps(self.key, sort_keys=True, separators=(",", ":")).encode()

    def value_bytes(self) -> bytes | None:
        return None if self.value is None else json.dumps(self.value, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, key: bytes, value: bytes | None, offset: int = -1, timestamp_ms: int = 0) -> LogRecord:
        """Parse the wire form; ``ValueError`` if either part is not a JSON object."""
        k = json.loads(key)
        v = None if value is None else json.loads(value)
        if not isinstance(k, dict) or not (v is None or isinstance(v, dict)):
            raise ValueError("a state record's key and value must be JSON objects")
        return cls(k, v, offset, timestamp_ms)


class StateTopic:
    """A one-partition compacted topic holding JSON state records.

    Created with ``replication_factor`` replicas; -1 (the default) takes the cluster's
    ``default.replication.factor``: 1 on a one-node stack, 3 on a three-node one.
    """

    def __init__(self, kafka: KafkaConnection, topic: str, timeout_s: float = 10.0, replication_factor: int = -1) -> None:
        self.kafka = kafka
        self.topic = topic
        self.timeout_s = timeout_s
        self.replication_factor = replication_factor
        self._producer: Producer | None = None

    def ensure(self) -> None:
        """Create the topic (1 partition, compacted) if it is missing."""
        admin = AdminClient(self.kafka.config())
        try:
            metadata = admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise StateLogError(
                f"Kafka at {self.kafka} is unreachable ({exc}); start the stack first (`tangram up`)."
            ) from exc
        if self.topic in metadata.topics:
            return
        new = NewTopic(self.topic, num_partitions=1, replication_factor=self.replication_factor,
                       config={"cleanup.policy": "compact"})
        future = admin.create_topics([new], operation_timeout=self.timeout_s)[self.topic]
        try:
            future.result(timeout=self.timeout_s)
            log.info("created compacted topic %s", self.topic)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise StateLogError(f"cannot create topic {self.topic}: {exc}") from exc
        self._wait_for_leader(admin)

    def _wait_for_leader(self, admin: AdminClient) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            topic = admin.list_topics(self.topic, timeout=self.timeout_s).topics.get(self.topic)
            if topic is not None and topic.error is None and topic.partitions and all(
                p.leader >= 0 for p in topic.partitions.values()
            ):
                return
            time.sleep(0.05)
        raise StateLogError(f"topic {self.topic} has no leader after {self.timeout_s}s; is Kafka healthy?")

    def replay(self, start: int = 0) -> Iterator[LogRecord]:
        """Every readable record from offset ``start`` (default: the beginning) up to the topic's current end."""
        consumer = Consumer(_consumer_conf(self.kafka, "replay"))
        try:
            low, high = self._watermarks(consumer)
            position = max(low, start)
            if high <= position:
                return
            consumer.assign([TopicPartition(self.topic, 0, position)])
            while position < high:
                msg = consumer.poll(self.timeout_s)
                if msg is None:
                    raise StateLogError(f"replay of {self.topic} stalled at offset {position} of {high}")
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        break
                    raise StateLogError(f"replay of {self.topic} failed: {msg.error()}")
                position = msg.offset() + 1
                record = _parse(msg, self.topic)
                if record is not None:
                    yield record
        finally:
            consumer.close()

    def _watermarks(self, consumer: Consumer) -> tuple[int, int]:
        """The topic's low and high watermarks, asking again while its leader is being elected (a topic just
        created, a broker just restarted) until ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=self.timeout_s)
            except KafkaException as exc:
                error = exc.args[0]
                if not (error.retriable() or error.code() in _LEADER_MOVING) or time.monotonic() >= deadline:
                    raise StateLogError(f"cannot read {self.topic} at {self.kafka}: {exc}; "
                                        "is Kafka up and the topic created?") from exc
                time.sleep(0.2)

    def append(self, records: Iterable[LogRecord]) -> list[int]:
        """Produce ``records`` in order (idempotent, ``acks=all``); wait for every ack; return their offsets."""
        if self._producer is None:
            self._producer = Producer(
                self.kafka.config({
                    "enable.idempotence": True,
                    "acks": "all",
                    "linger.ms": 0,
                    "message.timeout.ms": int(self.timeout_s * 1000),
                })
            )
        errors: list[str] = []
        offsets: list[int] = []

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                offsets.append(msg.offset())

        count = 0
        for record in records:
            self._producer.produce(self.topic, record.value_bytes(), record.key_bytes(), on_delivery=on_delivery)
            count += 1
        remaining = self._producer.flush(self.timeout_s)
        if errors or remaining:
            raise StateLogError(
                f"could not write {count} record(s) to {self.topic}: "
                f"{errors or f'{remaining} unacknowledged after {self.timeout_s}s'}; is Kafka up?"
            )
        return sorted(offsets)

    def close(self) -> None:
        """Flush and close the producer."""
        if self._producer is not None:
            self._producer.flush(self.timeout_s)
            self._producer.close()
            self._producer = None


class Replica:
    """A writer's copy of a state topic's state: ``refresh`` folds in every record it has not seen yet.

    ``state`` is any object with ``apply_record(LogRecord)``; subclasses add the operations that
    append records (model registry, config center).
    """

    def __init__(self, topic: StateTopic, state: Any) -> None:
        self.topic = topic
        self.state = state
        self._position = 0
        self._ensured = False

    def refresh(self) -> Any:
        """Catch up with every record on the topic; returns the state."""
        if not self._ensured:
            self.topic.ensure()
            self._ensured = True
        for record in self.topic.replay(self._position):
            self.state.apply_record(record)
            self._position = record.offset + 1
        return self.state


class Follows:
    """Start/stop and context management for a reader that owns a :class:`TopicFollower` as ``_follower``."""

    _follower: "TopicFollower"

    def start(self, wait: bool = True) -> Self:
        """Start following; by default wait until the state that exists now has been read."""
        self._follower.start()
        if wait:
            self._follower.wait_caught_up()
        return self

    def stop(self) -> None:
        self._follower.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class TopicFollower:
    """Tails a state topic from its beginning in a daemon thread, handing each record to ``on_record``.

    ``wait_caught_up`` returns once every record that existed when the follower started has
    been handed over, so a restarted processor starts from the latest state, not a partial one.
    """

    def __init__(self, kafka: KafkaConnection, topic: str, on_record: Callable[[LogRecord], None], *,
                 name: str = "follower", poll_s: float = 0.05, timeout_s: float = 10.0) -> None:
        self.kafka = kafka
        self.topic = topic
        self.on_record = on_record
        self.name = name
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.position = 0
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"tangram-follow-{name}", daemon=True)

    def start(self) -> TopicFollower:
        self._thread.start()
        return self

    def wait_caught_up(self, timeout_s: float | None = None) -> None:
        """Block until the state that existed at start has been applied; StateLogError past the deadline."""
        if not self._caught_up.wait(self.timeout_s if timeout_s is None else timeout_s):
            detail = f": {self._failure}" if self._failure else ""
            raise StateLogError(f"{self.name}: did not catch up with {self.topic} at {self.kafka} "
                                f"within {timeout_s or self.timeout_s}s{detail}; is Kafka up?")

    @property
    def caught_up(self) -> bool:
        return self._caught_up.is_set()

    def stop(self) -> None:
        """Stop following and close the consumer (waits at most ``timeout_s``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_s)

    def _run(self) -> None:
        consumer = Consumer({**_consumer_conf(self.kafka, self.name), "fetch.wait.max.ms": 50})
        try:
            high = self._initial_end(consumer)
            consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            if high == 0:
                self._caught_up.set()
            while not self._stop.is_set():
                msg = consumer.poll(self.poll_s)
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        self._caught_up.set()
                    elif msg.error().fatal():
                        raise KafkaException(msg.error())
                    else:
                        log.warning("%s: %s: %s", self.name, self.topic, msg.error())
                    continue
                self.position = msg.offset() + 1
                record = _parse(msg, self.topic)
                if record is not None:
                    try:
                        self.on_record(record)
                    except Exception:  # a bad record must not stop the live push
                        log.exception("%s: cannot apply %s[0]@%d", self.name, self.topic, msg.offset())
                if self.position >= high:
                    self._caught_up.set()
        except BaseException as exc:  # noqa: BLE001 - surfaced through wait_caught_up and the log
            self._failure = exc
            log.exception("%s: following %s failed", self.name, self.topic)
        finally:
            consumer.close()

    def _initial_end(self, consumer: Consumer) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=self.timeout_s)[1]
            except KafkaException as exc:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise StateLogError(f"cannot read {self.topic}: {exc}") from exc
                time.sleep(0.2)


def _consumer_conf(kafka: KafkaConnection, name: str) -> dict[str, Any]:
    return kafka.config({
        "group.id": f"tangram-statelog-{name}-{uuid.uuid4().hex[:8]}",  # never commits: assign() only
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "isolation.level": "read_committed",
    })


def _parse(msg: Any, topic: str) -> LogRecord | None:
    key = msg.key()
    if key is None:
        return None
    try:
        return LogRecord.from_bytes(key, msg.value(), msg.offset(), msg.timestamp()[1])
    except ValueError:
        log.warning("skipping unreadable record %s[0]@%d", topic, msg.offset())
        return None


def entity_share(entity: str, salt: str = "") -> float:
    """A stable number in [0, 1) for an entity key: the same entity always falls in the same share.

    Canary routing (``share = 0.05`` → the entities below 0.05) and scoped config values use it,
    so one device sees one model version and one config value, run after run.
    """
    digest = hashlib.sha256(f"{salt}:{entity}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def default_actor() -> str:
    """Who makes a change when nobody says: the OS user."""
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user database in some containers
        return "unknown"
