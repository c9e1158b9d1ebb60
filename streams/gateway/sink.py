"""``KafkaSink``: the gateways' producer. A caller hears "done" only once the broker acknowledged.

One idempotent producer (``acks=all``) per gateway process, served by a polling thread that
runs the delivery callbacks. ``produce`` calls ``done(failures)`` once every output of a
batch is acknowledged or has failed; ``deliver`` is the same for asyncio callers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from confluent_kafka import KafkaError, Message, Producer

from streams.delivery import RECORDS_OUT, Output
from streams.gateway.errors import GatewayError
from streams.security.kafka import KafkaConnection

log = logging.getLogger("tangram.gateway")

Done = Callable[[list[str]], None]


class KafkaSink:
    """Produces outputs and reports per batch when the broker has acknowledged all of them."""

    def __init__(self, kafka: KafkaConnection, client_id: str, *, name: str = "gateway", delivery_timeout_s: float = 30.0):
        self.name = name
        self.delivery_timeout_s = delivery_timeout_s
        self.producer = Producer(kafka.config({
            "client.id": client_id,
            "enable.idempotence": True,  # forces acks=all and ordered, duplicate-free retries
            "acks": "all",
            "linger.ms": 2,
            "compression.type": "lz4",
            "delivery.timeout.ms": int(delivery_timeout_s * 1000),
            "queue.buffering.max.messages": 1_000_000,
        }))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{name}-delivery", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    def produce(self, outputs: list[Output], done: Done) -> None:
        """Produce ``outputs``; ``done(failures)`` runs (on the delivery thread) once all are settled."""
        if not outputs:
            done([])
            return
        state = {"left": len(outputs)}
        failures: list[str] = []
        lock = threading.Lock()

        def settled(err: KafkaError | None, msg: Message) -> None:
            with lock:
                if err is not None:
                    failures.append(f"{msg.topic()}: {err.str()}")
                else:
                    RECORDS_OUT.labels(self.name, msg.topic()).inc()
                state["left"] -= 1
                finished = state["left"] == 0
            if finished:
                done(failures)

        for out in outputs:
            headers = [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in out.headers.items()]
            while True:
                try:
                    self.producer.produce(out.topic, out.value, out.key, headers=headers, on_delivery=settled)
                    break
                except BufferError:  # local queue full: the delivery thread drains it
                    time.sleep(0.005)

    async def deliver(self, outputs: list[Output]) -> None:
        """Produce ``outputs`` and return once the broker acknowledged every one; raise ``GatewayError`` if not."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[str]] = loop.create_future()

        def done(failures: list[str]) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(failures))

        self.produce(outputs, done)
        try:
            failures = await asyncio.wait_for(future, self.delivery_timeout_s + 5)
        except asyncio.TimeoutError:
            raise GatewayError(f"{len(outputs)} records not acknowledged within {self.delivery_timeout_s}s; "
                               "the producer should retry (duplicates are dropped by event_id)") from None
        if failures:
            raise GatewayError(f"{len(failures)} of {len(outputs)} records not delivered ({'; '.join(failures[:3])}); "
                               "the producer should retry")

    def close(self) -> None:
        """Wait for outstanding deliveries, then stop the delivery thread."""
        remaining = self.producer.flush(self.delivery_timeout_s)
        self._stop.set()
        self._thread.join(5)
        self.producer.close()
        if remaining:
            log.error("%s: %d records still unacknowledged at close", self.name, remaining)
