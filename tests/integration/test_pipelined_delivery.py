"""The delivery loop with a pipelined processor, on the real broker.

A pipelined processor (the inference worker) has a batch's service call in flight while the loop
delivers the batch before and fetches the batch after. These tests check that the guarantee is the
same as for one batch at a time: outputs in order per key, nothing lost, nothing twice in
exactly-once mode — through backpressure raised with batches in flight and through rebalances
that take partitions away while batches are in flight.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from streams.delivery import Output, Processor, Record, Runner, RunnerConfig
from streams.errors import BackpressureError
from streams.testing import count_records, read_rows

pytestmark = pytest.mark.integration

KEYS = 40


class Echo(Processor):
    """Copies each record to ``out`` after a service call that runs on a thread of its own.

    ``refuse`` holds the numbers of ``finish`` calls that raise BackpressureError instead (each once).
    ``overlaps`` counts the batches submitted before the loop came to finish the one before them.
    """

    name = "echo"
    pipelined = True

    def __init__(self, out: str, call_s: float, refuse: set[int] | None = None):
        self.out, self.call_s, self.refuse = out, call_s, set(refuse or ())
        self.pool = ThreadPoolExecutor(1)
        self.submitted = self.finished = self.overlaps = 0
        self.finishing: set[int] = set()  # numbers of the batches whose finish was called
        self.lock = threading.Lock()

    @classmethod
    def build(cls, ctx):  # made in the test, never from a topology
        raise AssertionError("Echo is built by the test itself")

    def process(self, batch: list[Record]) -> list[Output]:
        return self.submit(batch)()

    def submit(self, batch: list[Record]):
        call = self.pool.submit(time.sleep, self.call_s)
        with self.lock:
            number = self.submitted = self.submitted + 1
            if number > 1 and number - 1 not in self.finishing:
                self.overlaps += 1

        def finish() -> list[Output]:
            with self.lock:
                self.finishing.add(number)
            call.result()
            with self.lock:
                self.finished += 1
                if self.finished in self.refuse:
                    self.refuse.discard(self.finished)
                    raise BackpressureError(f"{self.name}: service refused batch {number}")
            return [Output(self.out, r.key, r.value, {"source": f"{r.partition}:{r.offset}"}) for r in batch]

        return finish

    def close(self) -> None:
        self.pool.shutdown()


def topics(stack, prefix: str) -> tuple[str, str]:
    source, sink = f"{prefix}.in", f"{prefix}.out"
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    for future in admin.create_topics([NewTopic(t, num_partitions=3, replication_factor=1)
                                       for t in (source, sink)], operation_timeout=30).values():
        future.result(timeout=30)
    return source, sink


def produce(stack, topic: str, n: int, per_s: float | None = None) -> list[bytes]:
    """``n`` records keyed by ``KEYS`` devices, value ``key:seq``; at ``per_s`` records/s when given."""
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 5})
    values, started = [], time.monotonic()
    for i in range(n):
        key = f"dev-{i % KEYS:03d}"
        value = f"{key}:{i // KEYS:06d}".encode()
        producer.produce(topic, value, key)
        values.append(value)
        if per_s and i % 100 == 99:
            producer.poll(0)
            time.sleep(max(0.0, started + (i + 1) / per_s - time.monotonic()))
    assert producer.flush(30) == 0
    return values


def runner(stack, group: str, source: str, processor: Processor, exactly_once: bool) -> Runner:
    return Runner(processor, RunnerConfig(kafka=stack.kafka, group_id=group,
                                          inputs=(source,), batch_size=50, max_wait_ms=50,
                                          exactly_once=exactly_once, backoff_initial_s=0.05, backoff_max_s=0.2,
                                          session_timeout_ms=6000))


def start(r: Runner) -> threading.Thread:
    thread = threading.Thread(target=r.run, daemon=True)
    thread.start()
    return thread


def wait_for_outputs(stack, sink: str, at_least: int, timeout_s: float = 120.0) -> None:
    """Until ``sink`` holds ``at_least`` records (end offsets: transaction markers count too)."""
    deadline = time.monotonic() + timeout_s
    while count_records(stack.kafka, sink) < at_least:
        assert time.monotonic() < deadline, f"{sink}: fewer than {at_least} outputs after {timeout_s}s"
        time.sleep(0.2)


def read_when_idle(stack, sink: str, n: int, timeout_s: float = 120.0) -> list:
    """Every record of ``sink`` once at least ``n`` are readable and nothing more arrives for 2 s."""
    deadline = time.monotonic() + timeout_s
    while len(outputs := read_rows(stack.kafka, sink, None, idle_s=2.0)) < n:
        assert time.monotonic() < deadline, f"{sink}: {len(outputs)} of {n} outputs after {timeout_s}s"
    return outputs


def check(outputs: list, inputs: list[bytes], exactly_once: bool) -> None:
    """Every input is out (once in exactly-once mode); per key, outputs follow the input order."""
    values = [m.value() for m in outputs]
    assert set(values) == set(inputs), f"{len(set(inputs) - set(values))} records lost"
    if exactly_once:
        assert len(values) == len(inputs), f"{len(values) - len(set(values))} duplicates in exactly-once mode"
    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    for m in sorted(outputs, key=lambda m: (m.partition(), m.offset())):
        by_key[m.key()].append(m.value())
    for key, seq in by_key.items():
        firsts = list(dict.fromkeys(seq))  # a duplicate (at-least-once) re-emits a run already seen
        assert firsts == sorted(firsts), f"{key!r}: outputs out of order"


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly-once", "at-least-once"])
def test_backpressure_with_batches_in_flight_loses_nothing(stack, exactly_once):
    source, sink = topics(stack, f"pipe{uuid.uuid4().hex[:8]}")
    inputs = produce(stack, source, 6000)
    echo = Echo(sink, call_s=0.003, refuse={3, 11, 12, 40})
    r = runner(stack, f"pipe-{uuid.uuid4().hex}", source, echo, exactly_once)
    thread = start(r)
    try:
        outputs = read_when_idle(stack, sink, len(inputs))
    finally:
        r.stop()
        thread.join(30)
    check(outputs, inputs, exactly_once)
    assert r.backpressure_events == 4 and not echo.refuse
    assert echo.overlaps > echo.submitted // 2, "the loop seldom had a batch in flight while delivering the one before"


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly-once", "at-least-once"])
def test_rebalances_with_batches_in_flight_lose_nothing(stack, exactly_once):
    source, sink = topics(stack, f"pipe{uuid.uuid4().hex[:8]}")
    n = 24_000  # 20 s of records at 1,200/s
    feeder_values: list[bytes] = []
    feeder = threading.Thread(target=lambda: feeder_values.extend(produce(stack, source, n, per_s=1200)), daemon=True)
    group = f"pipe-{uuid.uuid4().hex}"
    a_echo, b_echo = Echo(sink, call_s=0.004), Echo(sink, call_s=0.004)
    a, b = runner(stack, group, source, a_echo, exactly_once), runner(stack, group, source, b_echo, exactly_once)
    a_thread = start(a)
    feeder.start()
    try:
        wait_for_outputs(stack, sink, n // 8)
        b_thread = start(b)  # takes partitions from A while A has batches in flight
        deadline = time.monotonic() + 30
        while b_echo.finished < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b_echo.finished >= 10, "the second member never took partitions"
        b.stop()  # its partitions go back to A; its produced batch is committed, submitted ones are read again
        b_thread.join(30)
        assert feeder.is_alive(), "the feeder ended before the second member left: the test proves less than it says"
        feeder.join(60)
        outputs = read_when_idle(stack, sink, n)
    finally:
        a.stop()
        b.stop()
        a_thread.join(30)
    check(outputs, feeder_values, exactly_once)
    assert a.assignments >= 2, f"A saw {a.assignments} assignments: it never took B's partitions back"
    assert a_echo.overlaps > a_echo.submitted // 2
