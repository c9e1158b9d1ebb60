"""The raw confluent-kafka loop the stage benchmarks compare against.

Consume a batch, produce it unchanged, wait for the broker's acknowledgements, commit
asynchronously: the delivery loop's guarantee (at-least-once, offsets after the acks) with no
work in between. The clock starts at the first record consumed, so the group join is not
timed; runs must be long, though, because the consumer prefetches up to 64 MB while it joins
(see ``bench_ingest.py``).
"""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, Producer

from streams.settings import StackSettings


def raw_copy_seconds(stack: StackSettings, source: str, sink: str, n: int, batch: int = 500, every: int = 1) -> float:
    """Seconds to copy ``n`` records from ``source`` to ``sink`` (from the first record consumed).

    ``every`` > 1 writes one record for every ``every`` read (the value of that record, unchanged): the
    Kafka work of a stage that turns ``every`` readings into one window, with no decoding and no math.
    """
    consumer = Consumer(stack.kafka.config({"group.id": f"bench-raw-{uuid.uuid4().hex}", "enable.auto.commit": False,
                                            "auto.offset.reset": "earliest", "isolation.level": "read_committed"}))
    producer = Producer(stack.kafka.config({"enable.idempotence": True, "acks": "all", "linger.ms": 5,
                                            "compression.type": "lz4"}))
    consumer.subscribe([source])
    done, started = 0, None
    try:
        while done < n:
            messages = [m for m in consumer.consume(batch, 0.1) if m.error() is None]
            if not messages:
                continue
            started = started or time.perf_counter()
            for i, m in enumerate(messages, start=done):
                if i % every == every - 1:
                    producer.produce(sink, m.value(), m.key(), headers=m.headers())
            assert producer.flush(30) == 0, "raw loop: outputs not acknowledged"
            consumer.commit(asynchronous=True)  # after the acks, like the delivery loop
            done += len(messages)
        return time.perf_counter() - started
    finally:
        consumer.close()

