"""The delivery loop's producer: what a processor's outputs go through on their way to Kafka.

One idempotent producer (``acks=all``, ordered retries) per loop; in exactly-once mode it is
transactional, its id ``<group>-<replica>`` so that a restarted replica fences the dead one
(:class:`~streams.delivery.RunnerConfig`). A delivery (:mod:`streams.delivery`) opens with
:meth:`Outbox.begin`, produces its batches' outputs with :meth:`Outbox.send`, and is acknowledged
(:meth:`Outbox.acknowledged`) before anything is committed: a failed delivery report of any of its
outputs fails the whole delivery, whose offsets are then not committed.

An output over the producer's ``message.max.bytes`` is a dead letter cut to its first
``DLQ_KEPT_BYTES`` bytes (its headers say so and give the whole's sha256); any other output that large
is the processor's bug, and the loop stops rather than drop it.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from streams.errors import DeliveryError

if TYPE_CHECKING:
    from streams.delivery import Output, RunnerConfig

#: A dead letter over the producer's size limit keeps this many bytes of the original (and its sha256).
DLQ_KEPT_BYTES = 512 * 1024


def producer_config(config: "RunnerConfig", client_id: str, on_delivery: Any) -> dict:
    """The loop's producer: idempotent, failures-only delivery reports; transactional in exactly-once mode."""
    conf = config.kafka.config({
        "client.id": client_id,
        "enable.idempotence": True,  # forces acks=all and ordered retries
        "acks": "all",
        "linger.ms": 0.5,
        "compression.type": "lz4",
        "delivery.timeout.ms": int(config.delivery_timeout_s * 1000),
        # Delivery reports for failures only: no Python callback per acknowledged record.
        "delivery.report.only.error": True,
        "on_delivery": on_delivery,
    })
    if config.exactly_once:
        member = config.replica or config.group_instance_id or client_id
        conf["transactional.id"] = f"{config.group_id}-{member}"
        conf["transaction.timeout.ms"] = int(config.transaction_timeout_s * 1000)
        # librdkafka: a message may not outlive the transaction it belongs to.
        conf["delivery.timeout.ms"] = min(conf["delivery.timeout.ms"], conf["transaction.timeout.ms"])
    return conf


class Outbox:
    """Produces a loop's outputs, delivery by delivery (exactly-once: a transaction each)."""

    def __init__(self, name: str, config: "RunnerConfig", client_id: str, producer: Producer | None = None):
        """``producer`` replaces the one built from ``config`` (a fake in unit tests); it stays its giver's to close."""
        self.name = name
        self.config = config
        self.log = logging.getLogger(f"tangram.processor.{name}")
        self._owns_producer = producer is None
        self.producer = producer or Producer(producer_config(config, client_id, self._on_delivery))
        self._failures: list[str] = []

    def start(self) -> None:
        """Before the first delivery: in exactly-once mode, fence an earlier instance of this id (its open
        transaction is aborted)."""
        if self.config.exactly_once:
            self.producer.init_transactions(self.config.delivery_timeout_s)

    def begin(self) -> None:
        """A new delivery (exactly-once: its transaction begins)."""
        self._failures.clear()
        if self.config.exactly_once:
            self.producer.begin_transaction()

    def send(self, outputs: "list[Output]") -> None:
        """Produce ``outputs`` (in the open transaction in exactly-once mode)."""
        produce = self.producer.produce
        for out in outputs:
            try:  # the hot path: headers go as they are (str or bytes values)
                produce(out.topic, out.value, out.key, headers=out.headers or None)
            except (BufferError, TypeError):
                self._produce(out)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                self._produce(self._too_large(out, exc))

    def acknowledged(self) -> None:
        """Wait for the broker's acks of every output of the delivery; ``DeliveryError`` (exactly-once: its
        transaction aborted) when one failed or is not acknowledged within ``delivery_timeout_s``."""
        timeout = self.config.delivery_timeout_s
        remaining = self.producer.flush(timeout)
        if remaining or self._failures:
            if self.config.exactly_once:
                self.producer.abort_transaction()
            detail = "; ".join(self._failures[:3]) or f"{remaining} not acknowledged in {timeout}s"
            raise DeliveryError(f"{self.name}: outputs not delivered, offsets not committed: {detail}")

    def commit(self, offsets: list[TopicPartition], group: Any, wait_s: float) -> None:
        """Exactly-once: send the delivery's ``offsets`` (of consumer ``group``) to its transaction and commit it."""
        if offsets:
            self.producer.send_offsets_to_transaction(offsets, group, wait_s)
        self.producer.commit_transaction(wait_s)

    def abort(self) -> None:
        """Exactly-once: abort the delivery's transaction (its outputs are never read)."""
        self.producer.abort_transaction()

    def close(self) -> None:
        """Wait for what is still queued, and end the producer's threads now (not whenever it is collected)."""
        self.producer.flush(self.config.delivery_timeout_s)
        if self._owns_producer:
            self.producer.close()

    def _too_large(self, out: "Output", exc: KafkaException) -> "Output":
        """An output over the producer's ``message.max.bytes``: a dead letter keeps its first ``DLQ_KEPT_BYTES``
        bytes and says so in its headers; any other output stops the loop (nothing committed)."""
        if "dlq.reason" not in out.headers or out.value is None:
            raise DeliveryError(f"{self.name}: an output to {out.topic} of {len(out.value or b'')} bytes is "
                                f"over the producer's message.max.bytes ({exc.args[0].str()}); offsets not committed")
        digest = hashlib.sha256(out.value).hexdigest()
        self.log.warning("%s: dead letter to %s of %d bytes is over the size limit: keeping its first %d bytes "
                         "(sha256 of the whole: %s)", self.name, out.topic, len(out.value), DLQ_KEPT_BYTES, digest)
        headers = {**out.headers, "dlq.truncated_from_bytes": str(len(out.value)), "dlq.original_sha256": digest}
        return out._replace(value=out.value[:DLQ_KEPT_BYTES], headers=headers)

    def _produce(self, out: "Output") -> None:
        """Produce one output whatever its header values are, waiting while the local queue is full."""
        while True:
            try:
                self.producer.produce(out.topic, out.value, out.key,
                                      headers=[(k, v if isinstance(v, bytes) else str(v).encode())
                                               for k, v in out.headers.items()])
                return
            except BufferError:  # local queue full: serve delivery reports, then retry
                self.producer.poll(0.1)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE or "dlq.truncated_from_bytes" in out.headers:
                    raise
                out = self._too_large(out, exc)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._failures.append(f"{msg.topic()}: {err.str()}")


__all__ = ["DLQ_KEPT_BYTES", "Outbox", "producer_config"]
