"""The delivery loop under a failing service, with fake Kafka clients: side effects that wait pause the
partitions without blocking the loop, and a processor reading several topics is co-partitioned."""

from __future__ import annotations

from streams.delivery import Output, Processor, Record, Runner, RunnerConfig
from streams.errors import ServiceUnavailableError
from streams.kafka_fakes import FakeConsumer, FakeProducer, VirtualClock
from streams.security.kafka import KafkaConnection


class FlushesLate(Processor):
    """Echoes each record; its side effects (``flush``) fail ``failures`` times, as a Redis outage would."""

    name = "late-flush"

    def __init__(self, failures: int):
        self.failures = failures
        self.flushes = 0
        self.ready_asked = 0

    @classmethod
    def build(cls, ctx):  # pragma: no cover - built directly
        raise NotImplementedError

    def process(self, batch: list[Record]) -> list[Output]:
        return [Output("out", r.key, r.value) for r in batch]

    def flush(self) -> None:
        self.flushes += 1
        if self.flushes <= self.failures:
            raise ServiceUnavailableError(f"redis down (flush {self.flushes})", service="redis")

    def ready(self) -> bool:
        self.ready_asked += 1
        return True


def test_side_effects_that_fail_pause_the_partitions_then_commit_once_written_nothing_lost_or_repeated():
    clock = VirtualClock()
    consumer = FakeConsumer([("in", 0), ("in", 1)], clock)
    consumer.arrive("in", 0, [b"a", b"b", b"c"])
    consumer.arrive("in", 1, [b"d"])
    producer = FakeProducer()
    processor = FlushesLate(failures=2)
    runner = Runner(processor, RunnerConfig(kafka=KafkaConnection("fake:9092"), group_id="g", inputs=("in",),
                                            backoff_initial_s=0.01, backoff_max_s=0.02),
                    consumer=consumer, producer=producer)
    runner.run(max_batches=1)
    assert [v for _, v, _ in producer.acked] == [b"a", b"b", b"c", b"d"]  # produced once, never again
    assert processor.flushes == 3 and processor.ready_asked == 2
    assert consumer.committed == {("in", 0): 3, ("in", 1): 1}  # committed only after the side effects
    assert runner.backpressure_events == 1 and runner.paused_s > 0
    assert not any(p.paused for p in consumer._partitions.values())  # resumed


def test_a_processor_reading_several_topics_is_co_partitioned_with_the_range_assignor():
    one = RunnerConfig(kafka=KafkaConnection("x"), group_id="g", inputs=("a",))
    two = RunnerConfig(kafka=KafkaConnection("x"), group_id="g", inputs=("a", "b"))
    processor = FlushesLate(0)
    assert one.strategy(processor) == "cooperative-sticky"
    assert two.strategy(processor) == "range"
    processor.copartitioned = False
    assert two.strategy(processor) == "cooperative-sticky"
    forced = RunnerConfig(kafka=KafkaConnection("x"), group_id="g", inputs=("a", "b"), assignment_strategy="roundrobin")
    assert forced.strategy(FlushesLate(0)) == "roundrobin"
