"""Natural batching in the delivery loop, on fake Kafka clients with a virtual clock (no broker).

A batch is what is fetched already plus what arrives within ``linger_ms`` of its first record, up to
``batch_size``; ``max_wait_ms`` bounds only the wait for a first record. Each test asserts when (on
the virtual clock) each batch was taken, what it held, and that its offsets were committed after its
outputs were acknowledged.
"""

from __future__ import annotations

import pytest

from streams.security.kafka import KafkaConnection
from streams.delivery import MessageHeaders, Output, Processor, Record, Runner, RunnerConfig, dead_letter
from streams.kafka_fakes import FakeConsumer, FakeMessage, FakeProducer, VirtualClock


class Copy(Processor):
    """Copies each record to ``out``; remembers when each batch was taken and which offsets it held."""

    name = "copy"

    def __init__(self, clock: VirtualClock, producer: FakeProducer, consumer: FakeConsumer):
        self.clock, self.producer, self.consumer = clock, producer, consumer
        self.batches: list[tuple[float, list[tuple[int, int]]]] = []
        self.idle_at: list[float] = []
        self.acked_before_commit: list[bool] = []
        self.runner: Runner | None = None
        self.stop_after_idle = 0
        self.committed_when_idle: dict[tuple[str, int], int] = {}

    @classmethod
    def build(cls, ctx):
        raise TypeError("a test processor, made by hand")

    def process(self, batch: list[Record]) -> list[Output]:
        self.batches.append((self.clock.now, [(r.partition, r.offset) for r in batch]))
        return [Output("out", r.key, r.value) for r in batch]

    def flush(self) -> None:  # runs after the acks, before the commit
        acked = len(self.producer.acked)
        taken = sum(len(offsets) for _, offsets in self.batches)
        self.acked_before_commit.append(acked == taken)

    def idle(self) -> list[Output]:
        self.idle_at.append(self.clock.now)
        self.committed_when_idle = dict(self.consumer.committed)
        if len(self.idle_at) >= self.stop_after_idle and self.runner is not None:
            self.runner.stop()
        return []


def loop(partitions: int = 1, **config) -> tuple[Runner, Copy, FakeConsumer, FakeProducer]:
    clock = VirtualClock()
    consumer = FakeConsumer([("in", p) for p in range(partitions)], clock)
    producer = FakeProducer()
    copy = Copy(clock, producer, consumer)
    settings = {"batch_size": 500, "max_wait_ms": 100, "linger_ms": 5, **config}
    runner = Runner(copy, RunnerConfig(kafka=KafkaConnection("fake:9092"), group_id="g", inputs=("in",), **settings),
                    consumer=consumer, producer=producer)
    copy.runner = runner
    consumer.on_commit = runner.offsets.on_commit  # the callback the consumer's configuration names
    return runner, copy, consumer, producer


def test_a_lone_record_waits_the_linger_not_max_wait():
    runner, copy, consumer, producer = loop()
    consumer.arrive("in", 0, [b"a"], at=0.010)
    consumer.arrive("in", 0, [b"b"], at=0.012)  # within the first record's linger: same batch
    consumer.arrive("in", 0, [b"c"], at=0.070)
    runner.run(max_batches=2)
    (t1, first), (t2, second) = copy.batches
    assert t1 == pytest.approx(0.015) and first == [(0, 0), (0, 1)]
    assert t2 == pytest.approx(0.075) and second == [(0, 2)]  # one consume(500, 100 ms) would hold all until 0.110
    assert [value for _, value, _ in producer.acked] == [b"a", b"b", b"c"]
    assert consumer.committed == {("in", 0): 3}
    assert copy.acked_before_commit == [True, True]


@pytest.mark.parametrize("interval_ms, deliveries", [(60_000, 1), (0, 3)])
def test_under_load_batches_fill_to_batch_size_without_waiting(interval_ms, deliveries):
    """Under load batches fill from what is fetched; only the short last one lingers. The batches read while
    records are at hand are one delivery (acks, side effects, commit once); ``commit_interval_ms: 0``: three."""
    runner, copy, consumer, producer = loop(partitions=2, commit_interval_ms=interval_ms)
    consumer.arrive("in", 0, [b"x"] * 700, at=0.0)
    consumer.arrive("in", 1, [b"y"] * 500, at=0.0)
    runner.run(max_batches=3)
    assert [len(offsets) for _, offsets in copy.batches] == [500, 500, 200]
    assert [t for t, _ in copy.batches] == pytest.approx([0.0, 0.0, 0.005])
    assert copy.acked_before_commit == [True] * deliveries  # one flush a delivery, after all its acks
    assert len(producer.acked) == 1200
    assert consumer.committed == {("in", 0): 700, ("in", 1): 500}


def test_a_delivery_whose_outputs_are_not_acknowledged_commits_none_of_its_batches():
    class Unacknowledged(FakeProducer):
        def flush(self, timeout: float | None = None) -> int:
            return len(self._queued)  # the broker acknowledged none of them

    clock = VirtualClock()
    consumer = FakeConsumer([("in", 0), ("in", 1)], clock)
    producer = Unacknowledged()
    copy = Copy(clock, producer, consumer)
    runner = Runner(copy, RunnerConfig(kafka=KafkaConnection("fake:9092"), group_id="g", inputs=("in",),
                                       batch_size=500, commit_interval_ms=60_000), consumer=consumer, producer=producer)
    consumer.arrive("in", 0, [b"x"] * 700, at=0.0)
    consumer.arrive("in", 1, [b"y"] * 500, at=0.0)
    runner.run(max_batches=3)  # one delivery of three batches, ended on the way out: its acks never come
    assert [len(offsets) for _, offsets in copy.batches] == [500, 500, 200]
    assert copy.acked_before_commit == [] and consumer.committed == {}  # no side effect, no offset: read again


def test_max_wait_bounds_the_wait_for_a_first_record():
    runner, copy, consumer, _ = loop()
    copy.stop_after_idle = 3
    consumer.arrive("in", 0, [b"late"], at=0.250)
    runner.run()
    assert copy.idle_at == pytest.approx([0.1, 0.2, 0.355])  # idle ticks every max_wait_ms while nothing comes
    [(taken, offsets)] = copy.batches
    assert taken == pytest.approx(0.255) and offsets == [(0, 0)]
    assert consumer.committed == {("in", 0): 1}


def test_the_linger_never_exceeds_max_wait():
    runner, copy, consumer, _ = loop(max_wait_ms=10, linger_ms=50)
    consumer.arrive("in", 0, [b"a"], at=0.0)
    consumer.arrive("in", 0, [b"b"], at=0.020)
    runner.run(max_batches=2)
    assert [t for t, _ in copy.batches] == pytest.approx([0.010, 0.030])
    assert [offsets for _, offsets in copy.batches] == [[(0, 0)], [(0, 1)]]


def test_without_linger_a_batch_is_what_is_fetched():
    runner, copy, consumer, _ = loop(linger_ms=0)
    consumer.arrive("in", 0, [b"a"], at=0.010)
    consumer.arrive("in", 0, [b"b"], at=0.011)
    runner.run(max_batches=2)
    assert copy.batches == [(pytest.approx(0.010), [(0, 0)]), (pytest.approx(0.011), [(0, 1)])]


def test_records_of_a_partition_revoked_while_lingering_are_left_to_its_new_owner():
    runner, copy, consumer, producer = loop(partitions=2)
    consumer.arrive("in", 0, [b"kept"], at=0.0)
    consumer.arrive("in", 1, [b"moved"], at=0.0)
    consumer.revoke_at(0.002, [("in", 1)])  # a rebalance served inside the linger's consume call
    runner.run(max_batches=1)
    [(taken, offsets)] = copy.batches
    assert taken == pytest.approx(0.005) and offsets == [(0, 0)]
    assert [value for _, value, _ in producer.acked] == [b"kept"]
    assert consumer.committed == {("in", 0): 1}  # nothing of the revoked partition committed here


def test_exactly_once_commits_each_batch_in_its_transaction_after_the_acks():
    runner, copy, consumer, producer = loop(exactly_once=True)
    consumer.arrive("in", 0, [b"a"], at=0.0)
    consumer.arrive("in", 0, [b"b"], at=0.050)
    runner.run(max_batches=2)
    assert [len(offsets) for _, offsets in copy.batches] == [1, 1]
    assert producer.transactions == ["begin", "offsets", "commit"] * 2
    assert len(producer.acked) == 2 and copy.acked_before_commit == [True, True]


def test_exactly_once_one_transaction_spans_the_batches_at_hand():
    runner, copy, consumer, producer = loop(exactly_once=True, commit_interval_ms=60_000)
    consumer.arrive("in", 0, [b"x"] * 1200, at=0.0)
    consumer.arrive("in", 0, [b"y"], at=0.050)  # after a quiet fetch: the first transaction is committed by then
    runner.run(max_batches=4)
    assert [len(offsets) for _, offsets in copy.batches] == [500, 500, 200, 1]
    assert producer.transactions == ["begin", "offsets", "commit"] * 2
    assert len(producer.acked) == 1201 and copy.acked_before_commit == [True, True]


def test_a_refused_commit_is_made_again_when_the_loop_is_idle():
    runner, copy, consumer, _ = loop()
    copy.stop_after_idle = 1
    consumer.arrive("in", 0, [b"a", b"b"], at=0.0)
    consumer.refuse_commits = 1  # the batch's commit lands in a rebalance
    runner.run()
    assert [offsets for _, offsets in copy.batches] == [[(0, 0), (0, 1)]]
    assert copy.committed_when_idle == {("in", 0): 2}  # made again at the idle tick, before any shutdown commit


class CountedMessage(FakeMessage):
    """A message that counts its ``headers()`` calls (librdkafka parses the headers on the first)."""

    __slots__ = ("calls",)

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def headers(self):
        self.calls += 1
        return super().headers()


def test_lazy_headers_are_read_from_the_message_once_and_only_when_used():
    trace = [("event_id", b"dev-1:5000"), ("trace_id", b"abc")]
    used, unused, bare = (CountedMessage("in", 0, i, b"k", b"v", h, 0) for i, h in enumerate([trace, trace, None]))
    headers = MessageHeaders(used)
    assert used.calls == 0
    assert headers.get("trace_id") == b"abc" and headers["event_id"] == b"dev-1:5000" and "ingest_ms" not in headers
    assert dict(headers) == dict(trace) and len(headers) == 2 and used.calls == 1
    MessageHeaders(unused)
    assert unused.calls == 0
    assert dict(MessageHeaders(bare)) == {} and MessageHeaders(bare).get("trace_id", b"") == b""
    letter = dead_letter(Record("in", 0, 0, b"k", b"v", headers, 0), "dlq", "stage", "bad", "bad")
    assert letter.headers["trace_id"] == b"abc" and letter.headers["dlq.reason"] == "bad"


def test_a_processor_that_reads_few_headers_gets_them_lazily_with_the_same_values():
    class Lazy(Copy):
        lazy_headers = True

        def process(self, batch: list[Record]) -> list[Output]:
            self.seen = [(type(r.headers), dict(r.headers)) for r in batch]
            return super().process(batch)

    clock = VirtualClock()
    consumer, producer = FakeConsumer([("in", 0)], clock), FakeProducer()
    lazy = Lazy(clock, producer, consumer)
    runner = Runner(lazy, RunnerConfig(kafka=KafkaConnection("fake:9092"), group_id="g", inputs=("in",), batch_size=10,
                                       max_wait_ms=100, linger_ms=5), consumer=consumer, producer=producer)
    consumer.on_commit = runner.offsets.on_commit
    consumer.arrive("in", 0, [b"a"], at=0.010, headers=[("trace_id", b"t1")])
    consumer.arrive("in", 0, [b"b"], at=0.011)
    runner.run(max_batches=1)
    assert lazy.seen == [(MessageHeaders, {"trace_id": b"t1"}), (MessageHeaders, {})]
    assert consumer.committed == {("in", 0): 2}


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_loop_embedded_in_a_process_leaves_its_garbage_collectable_and_a_process_of_its_own_freezes_its_heap():
    import gc
    import weakref

    assert gc.get_freeze_count() == 0
    # embedded (a test, an application's thread): the cycle that is garbage by then is still collected afterwards
    runner, copy, consumer, producer = loop()
    consumer.arrive("in", 0, [b"a"], at=0.010)
    node = _Node()
    gone = weakref.ref(node)
    runner.run(max_batches=1)
    assert gc.get_freeze_count() == 0
    del node
    gc.collect()
    assert gone() is None and [value for _, value, _ in producer.acked] == [b"a"]

    # a process of its own (`tangram run` sets it): what setup built is frozen out of the collector's scans
    runner, copy, consumer, producer = loop()
    runner.freeze_heap = True
    consumer.arrive("in", 0, [b"b"], at=0.010)
    try:
        runner.run(max_batches=1)
        assert gc.get_freeze_count() > 0 and [value for _, value, _ in producer.acked] == [b"b"]
    finally:
        gc.unfreeze()
