"""Delivery guarantees, in one place. Every processor runs inside this loop.

At-least-once (default)
    consume a micro-batch → ``processor.process`` → produce every output → the next
    batch, and so on for up to ``commit_interval_ms``; then wait until the broker
    acknowledged all their outputs (``acks=all``, idempotent producer) →
    ``processor.flush`` (side effects such as Redis writes) → commit the offsets
    (asynchronously: they follow acknowledged outputs; synchronously on revocation
    and shutdown). The delivery ends early whenever the input has nothing more at
    hand, before a back-off, a revocation and shutdown: at low rates every batch is
    delivered at once; under load the loop reads the next batch instead of waiting
    for the acks of the last. A crash anywhere before the commit re-delivers the
    batches; nothing is committed that has not been delivered. Processors that keep state across
    batches (windows) say which offsets they still need (``committable``) and the
    commit never passes them. A processor whose ``flush`` writes in a thread of its
    own (the feature engine's online-store write) returns the write's future: the
    loop reads and processes the next batch while it is written, and commits the
    batch once it is (one write in flight at most, written in order).

Exactly-once (``exactly_once: true`` in the topology)
    the outputs and the consumed offsets go in one Kafka transaction
    (``send_offsets_to_transaction``); readers use ``read_committed``. A transaction spans
    the batches of one delivery (``commit_interval_ms``, as Kafka Streams' commit interval):
    its outputs are acknowledged, its side effects flushed and its offsets sent once, at its
    end. It ends early whenever the input has nothing more at hand, before a back-off, a
    revocation and shutdown, so a quiet stream's outputs are visible at once.

Pipelining (processors that wait on a service, such as the inference worker)
    a processor with ``pipelined = True`` starts a batch in ``submit`` (its
    Triton call goes out) and the loop completes the previous batch meanwhile
    (its delivery, when due), then finishes the new batch and produces its
    outputs. Same guarantee: offsets are committed in order after their own
    outputs' acks, and the open delivery (exactly-once: its transaction) ends
    before partitions are revoked.

A record that cannot be processed is never dropped and never blocks its
partition: the processor turns it into a dead letter (``dead_letter``) carrying
the original bytes and the reason in its headers, delivered like any output.

Natural batching
    a batch is what is fetched already, plus what arrives within ``linger_ms`` of its first
    record (up to ``batch_size``): at low rates a record waits a few milliseconds, not
    ``max_wait_ms``, at each stage; under load batches still fill to ``batch_size`` from what
    is fetched. ``max_wait_ms`` bounds only the wait for a first record (then ``idle`` runs).
    While batches are in flight nothing is waited for.

Backpressure
    a processor that cannot make progress now (a service it needs is slow or
    down) raises :class:`~streams.errors.BackpressureError` from ``process``.
    Nothing of that batch is produced or committed: the loop pauses every
    assigned partition, seeks each partition of the batch back to its first
    offset (the uncommitted position), and keeps polling (polls return nothing
    while paused, so ``max.poll.interval.ms`` is never exceeded and the group
    never rebalances) while it backs off exponentially and asks the processor
    whether it is ``ready()``. Then it resumes, reads the same records again and
    retries them. Works the same in both delivery modes (:mod:`streams.backpressure`).

The loop's producer, its acknowledgements and transactions: :mod:`streams.outbox`; the partitions it owns and
the positions it commits of them: :mod:`streams.offsets`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import hashlib
import itertools
import logging
import os
import signal
import threading
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from prometheus_client import Counter, Histogram

from streams.backpressure import Backpressure, first_offsets
from streams.errors import BackpressureError, DeliveryError
from streams.offsets import Offsets
from streams.outbox import Outbox
from streams.security.kafka import KafkaConnection

if TYPE_CHECKING:
    from typing import Self

    from streams.context import BuildContext

log = logging.getLogger("tangram.delivery")

RECORDS_IN = Counter("tangram_processor_records_in_total", "Records consumed.", ["processor"])
INGEST_TO_COMMIT = Histogram(
    "tangram_processor_ingest_to_commit_seconds",
    "From a record's originating event entering Tangram (ingest_ms header) to this stage committing it (sampled).",
    ["processor"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RECORDS_OUT = Counter("tangram_processor_records_out_total", "Records produced and acknowledged.", ["processor", "topic"])
DEAD_LETTERS = Counter("tangram_processor_dead_letters_total", "Records sent to a DLQ.", ["processor", "reason"])
BATCH_SECONDS = Histogram(
    "tangram_processor_batch_duration_seconds",
    "Consume-to-commit time of one micro-batch.",
    ["processor"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
TRANSACTIONS_ABORTED = Counter(
    "tangram_processor_transactions_aborted_total",
    "Exactly-once batches whose transaction was aborted (the group moved on); their records are read again.",
    ["processor"],
)

#: While side effects are written in the processor's thread, how often the loop looks for a first record.
WRITING_POLL_S = 0.002

#: Header names carried by every record (DESIGN.md, "Contracts and wire format").
H_EVENT_ID = "event_id"
H_TRACE_ID = "trace_id"
H_INGEST_MS = "ingest_ms"  # when the originating event entered Tangram; carried unchanged to the action
H_TRACEPARENT = "traceparent"  # W3C Trace Context, one span per hop


class Record(NamedTuple):
    """One consumed record, as processors see it (a named tuple: built once per record on the hot path)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Mapping[str, bytes]
    timestamp_ms: int

    @property
    def where(self) -> str:
        """``topic[partition]@offset``, for log lines and DLQ headers."""
        return f"{self.topic}[{self.partition}]@{self.offset}"

    def header(self, name: str, default: str = "") -> str:
        value = self.headers.get(name)
        return value.decode("utf-8", "replace") if value is not None else default


_NO_HEADERS: Mapping[str, str | bytes] = MappingProxyType({})


class MessageHeaders(Mapping):
    """A consumed message's headers, read from it on first use (:attr:`Processor.lazy_headers`).

    librdkafka parses a message's headers on the first ``headers()`` call: 5.5 µs for the four tracing headers
    every Tangram record carries on the machine of docs/performance.md's 2026-12-04 section, a third of the
    feature stage's CPU a reading there. A processor that
    looks at few records' headers (the newest reading of a closing window, a prediction that fires) pays
    only for those.
    """

    __slots__ = ("_message", "_headers")

    def __init__(self, message: Message):
        self._message: Message | None = message
        self._headers: dict[str, bytes] = {}

    def _read(self) -> dict[str, bytes]:
        if self._message is not None:
            headers, self._message = self._message.headers(), None
            if headers:
                self._headers = dict(headers)
        return self._headers

    def __getitem__(self, name: str) -> bytes:
        return self._read()[name]

    def get(self, name: str, default=None):
        return self._read().get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._read()

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())


def _headers_now(message: Message) -> dict[str, bytes]:
    """A consumed message's headers, read as it is consumed (a processor that reads most records' headers)."""
    headers = message.headers()
    return dict(headers) if headers else {}


class Output(NamedTuple):
    """One record to produce. ``key`` is the entity (UTF-8) so partitioning is by entity.

    A named tuple, like :class:`Record`: built once per record on the hot path."""

    topic: str
    key: str | bytes | None
    value: bytes | None
    headers: Mapping[str, str | bytes] = _NO_HEADERS


def traceparent(trace_id: str, span_of: str) -> str:
    """A W3C ``traceparent`` for one hop: the trace's id and a span id derived from what the hop produced."""
    span = hashlib.sha256(f"{trace_id}:{span_of}".encode()).hexdigest()[:16]
    return f"00-{trace_id}-{span}-01"


_CARRIED = (H_EVENT_ID, H_TRACE_ID, H_INGEST_MS)


def carry_headers(record: Record, **extra: str) -> dict[str, str | bytes]:
    """The tracing headers of ``record`` to put on an output derived from it.

    The trace id and the ingest time travel unchanged; each hop gets a ``traceparent`` of its own
    (W3C Trace Context), its span id derived from the output's ``event_id`` so replays reproduce it.
    """
    headers = record.headers
    out: dict[str, str | bytes] = {k: headers[k] for k in _CARRIED if k in headers}
    out.update(extra)
    trace = out.get(H_TRACE_ID)
    if trace:
        trace = trace.decode() if isinstance(trace, bytes) else trace
        event = out.get(H_EVENT_ID, b"")
        out[H_TRACEPARENT] = traceparent(trace, event.decode() if isinstance(event, bytes) else event)
    return out


def dead_letter(record: Record, dlq_topic: str, stage: str, error: BaseException | str, reason: str | None = None) -> Output:
    """The DLQ record for ``record``: original key and value untouched, the why in headers."""
    error_class = type(error).__name__ if isinstance(error, BaseException) else "Rejected"
    message = str(error)
    headers: dict[str, str | bytes] = dict(record.headers)
    headers.update(
        {
            "dlq.stage": stage,
            "dlq.reason": reason or error_class,
            "dlq.error_class": error_class,
            "dlq.error_message": message[:1000],
            "dlq.source_topic": record.topic,
            "dlq.source_partition": str(record.partition),
            "dlq.source_offset": str(record.offset),
            "dlq.failed_ms": str(int(time.time() * 1000)),
        }
    )
    return Output(dlq_topic, record.key, record.value, headers)


class Processor(ABC):
    """User logic of one stage. Implementations are plain classes; this loop owns Kafka.

    ``tangram run`` makes one with :meth:`build` from its declaration in the topology. For a stage
    that decodes, transforms and encodes records, :class:`streams.stage.Stage` does the plumbing;
    subclass this directly for state kept across batches or a batch-at-a-time hot path.
    """

    name: str = "processor"
    #: ``submit`` starts work that runs while the loop delivers the batch before (see the module's doc).
    #: A pipelined processor keeps no state across batches: a batch may be read and submitted again.
    pipelined: bool = False
    #: Runs as exactly one replica whatever its partitions (its decisions are global, e.g. a model's canary):
    #: deploy targets never scale it out.
    singleton: bool = False
    #: Reading several topics, gets the same partition numbers of each (Kafka Streams' co-partitioning: the
    #: ``range`` assignor), so that per-entity state sees every topic's records of its entities — the
    #: producers key every topic by the entity. False lets the group balance each topic on its own.
    copartitioned: bool = True
    #: The services outside Kafka it calls (``triton``, ``redis``, ``registry``, ``http``): its topology
    #: ``calls:`` may declare only these (``tangram plan`` refuses a declaration nothing would execute).
    #: Every processor built from a topology reads the registry for its codecs.
    services: frozenset[str] = frozenset({"registry"})
    #: Reads model artifacts (model cards, baselines, digests) from the stack's model repository
    #: (``TANGRAM_MODEL_REPOSITORY``): deploy targets give it the model server's repository.
    needs_models: bool = False
    #: Changes what it does from the config center without a restart while its ``live_config`` param is on
    #: (default on), so a topology may declare ``state.hot_reload`` for it. The built-in kinds are known to
    #: ``tangram plan``; a custom kind that follows live config says so here.
    reloads_live: bool = False
    #: Reads the headers of few of its records (:class:`MessageHeaders`): each record's are read from the
    #: message when first used rather than for every record as it is consumed.
    lazy_headers: bool = False

    @classmethod
    @abstractmethod
    def build(cls, ctx: "BuildContext") -> "Self":
        """Make the processor from its declaration: ``ctx`` holds its spec, settings, codecs and the stack."""

    def setup(self) -> None:
        """Open connections (Triton, Redis). Called once before the first batch."""

    @abstractmethod
    def process(self, batch: list[Record]) -> list[Output]:
        """Turn a micro-batch into outputs (dead letters included). Must not raise for bad records."""

    def submit(self, batch: list[Record]) -> Callable[[], list[Output]]:
        """Start work on ``batch``; the loop calls what this returns for its outputs (raising like ``process``).

        A ``pipelined`` processor starts here what waits on a service, so that the wait overlaps the
        delivery of the batch before. The default defers ``process`` to that call.
        """
        return functools.partial(self.process, batch)

    def flush(self) -> Future | None:
        """Make side effects outside Kafka durable. Called after outputs are acknowledged, before the commit.

        A processor that writes them in a thread of its own returns that write's future: at-least-once, the loop
        goes on reading and processing the next batch meanwhile and commits this batch's offsets once the future
        is done (its ``BackpressureError`` is backpressure, as if raised here); exactly-once, it waits for it
        before the transaction commits. Called again only once the future before is done."""
        return None

    def committable(self, partition: TopicPartition) -> int | None:
        """The earliest offset of ``partition`` still needed by state kept across batches, if any."""
        return None

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Drop state of partitions this instance no longer owns (their new owner rebuilds it)."""

    def idle(self) -> list[Output]:
        """Called when a poll returned nothing; may emit outputs (timers)."""
        return []

    def ready(self) -> bool:
        """After a :class:`BackpressureError`: can the processor make progress again? Must answer within seconds."""
        return True

    def close(self) -> None:
        """Release connections."""


class _Submitted(NamedTuple):
    """A batch handed to ``Processor.submit``: nothing of it is produced yet."""

    records: list[Record]
    finish: Callable[[], list[Output]]
    started: float  # perf_counter() when it was submitted


class _Sent(NamedTuple):
    """A batch whose outputs are produced: its acks, side effects and commit are outstanding."""

    outputs: list[Output]
    offsets: list[TopicPartition]
    records: list[Record]
    started: float  # perf_counter() when the batch was submitted


class _Writing(NamedTuple):
    """Delivered batches whose side effects are being written (``Processor.flush``'s future): their commit waits."""

    written: Future
    batches: list[_Sent]


@dataclass(frozen=True)
class RunnerConfig:
    kafka: KafkaConnection
    group_id: str
    inputs: tuple[str, ...]
    batch_size: int = 500
    max_wait_ms: int = 100
    #: Once a batch's first record is there, how long to wait for more (capped at ``max_wait_ms``).
    linger_ms: int = 5
    exactly_once: bool = False
    delivery_timeout_s: float = 30.0
    client_id: str = ""
    backoff_initial_s: float = 0.25  # first pause after a BackpressureError; doubles up to backoff_max_s
    backoff_max_s: float = 5.0
    max_poll_interval_ms: int = 300_000
    #: A killed member's partitions move to a live one after this long without its heartbeats: 6 s, the
    #: broker's default ``group.min.session.timeout.ms`` (librdkafka heartbeats from its own thread, every
    #: third of it, whatever Python is doing).
    session_timeout_ms: int = 6_000
    #: Static group membership (KIP-345): a member restarted with the same id takes its partitions
    #: back without a rebalance, and, in exactly-once mode, its transactional id fences and aborts
    #: the dead instance's open transaction at once. Defaults to $TANGRAM_GROUP_INSTANCE_ID.
    group_instance_id: str = field(default_factory=lambda: os.environ.get("TANGRAM_GROUP_INSTANCE_ID", ""))
    #: Exactly-once: this member's name among its group's replicas (``TANGRAM_REPLICA``, which the launcher
    #: sets; a StatefulSet's ordinal would do): the transactional id is ``<group>-<replica>``, so a replica
    #: restarted after a crash fences the dead instance and has the broker abort its open transaction at
    #: once, instead of the readers waiting ``transaction_timeout_s`` for it. Without it (or a
    #: ``group_instance_id``), a fresh id per start.
    replica: str = field(default_factory=lambda: os.environ.get("TANGRAM_REPLICA", ""))
    #: Exactly-once: the broker aborts a transaction left open this long (Kafka Streams' default).
    transaction_timeout_s: float = 10.0
    #: A delivery spans the batches produced within this long (Kafka Streams' ``commit.interval.ms``): their
    #: acks are waited for, side effects written and offsets committed once, at its end (exactly-once: one
    #: transaction). It ends early when the input has nothing more at hand. 0: every batch on its own.
    commit_interval_ms: int = 100
    #: librdkafka's ``partition.assignment.strategy``; default: ``range`` for a processor reading several
    #: topics co-partitioned (``Processor.copartitioned``), else ``cooperative-sticky`` (incremental rebalances).
    assignment_strategy: str | None = None

    def strategy(self, processor: "Processor") -> str:
        """The assignment strategy of ``processor``'s consumer (see ``assignment_strategy``)."""
        if self.assignment_strategy:
            return self.assignment_strategy
        return "range" if len(self.inputs) > 1 and processor.copartitioned else "cooperative-sticky"


class Watchdog:
    """Ends the process when a blocking client call overruns its deadline by far: a call that never returns
    holds the loop (and its partitions) forever, where a restart of the process recovers."""

    def __init__(self, name: str):
        self.name = name
        self._deadline: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, daemon=True, name="delivery-watchdog").start()

    @staticmethod
    @contextlib.contextmanager
    def deadline(watchdog: "Watchdog | None", seconds: float, what: str):
        """Within the block, the process may not stay longer than ``seconds`` (no watchdog: no bound)."""
        if watchdog is None:
            yield
            return
        watchdog._what, watchdog._deadline = what, time.monotonic() + seconds
        try:
            yield
        finally:
            watchdog._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                logging.getLogger("tangram.delivery").critical(
                    "%s: stuck %s past its deadline; the process ends so that a restart recovers", self.name,
                    self._what)
                logging.shutdown()
                os._exit(75)


class Runner:
    """Runs one processor: the consume → process → deliver → flush → commit loop."""

    def __init__(self, processor: Processor, config: RunnerConfig, *, consumer: Consumer | None = None,
                 producer: Producer | None = None):
        """``consumer`` and ``producer`` replace the clients built from ``config`` (fakes in unit tests:
        :mod:`streams.testing`)."""
        self.processor = processor
        self.config = config
        self.log = logging.getLogger(f"tangram.processor.{processor.name}")
        self._stop = threading.Event()
        client_id = config.client_id or f"{config.group_id}-{uuid.uuid4().hex[:8]}"
        self._linger_s = min(config.linger_ms, config.max_wait_ms) / 1000
        self.consumer = consumer or Consumer(
            config.kafka.config({
                "group.id": config.group_id,
                "client.id": client_id,
                "enable.auto.commit": False,  # offsets are committed by this loop only, after delivery
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                # range: partition i of every input to the same member (co-partitioned state); see RunnerConfig
                "partition.assignment.strategy": config.strategy(processor),
                "max.poll.interval.ms": config.max_poll_interval_ms,
                "session.timeout.ms": config.session_timeout_ms,
                "heartbeat.interval.ms": max(config.session_timeout_ms // 3, 100),
                **({"group.instance.id": config.group_instance_id} if config.group_instance_id else {}),
                "on_commit": lambda err, partitions: self.offsets.on_commit(err, partitions),
            })
        )
        self.offsets = Offsets(self.consumer, processor.name, config.exactly_once, self.log)
        self.outbox = Outbox(processor.name, config, client_id, producer)
        self._submitted: collections.deque[_Submitted] = collections.deque()  # submitted, outputs not produced yet
        self._pending: _Sent | None = None  # a pipelined processor's batch: produced, acks and commit outstanding
        self._writing: _Writing | None = None  # acknowledged batches: side effects being written, commit outstanding
        self._open: list[_Sent] = []  # produced batches of the open delivery (exactly-once: of its transaction)
        self._open_ends = 0.0  # monotonic time by which the open delivery ends
        self._rewound: dict[tuple[str, int], int] = {}  # partitions sought back in a rebalance callback
        self._in_callback = False
        self._revoked: set[tuple[str, int]] = set()  # partitions revoked during the current fetch
        self.backpressure = Backpressure(processor, self.consumer, config, self._stop, self._usable)
        self._watchdog: Watchdog | None = None  # set for a processor that is a process of its own
        #: Freeze the heap after setup (``gc.freeze``): for a loop that is its process's own work (``tangram run``,
        #: a benchmark's timed stage). What setup built (modules, clients, models) then lives as long as the process
        #: outside the collector's scans, which otherwise grow with it and show up as pauses on the hot path. Left
        #: off for a loop embedded in a longer-lived process (tests, an application's threads): a freeze keeps
        #: everything of that process alive at that moment for good, cyclic garbage and its Kafka clients included.
        self.freeze_heap = False
        #: Partition assignments received (one per rebalance this member took part in).
        self.assignments = 0

    @property
    def backpressure_events(self) -> int:
        """Batches put back after a BackpressureError, and side effects retried."""
        return self.backpressure.events

    @property
    def paused_s(self) -> float:
        """Seconds spent with every partition paused (backpressure)."""
        return self.backpressure.paused_s

    # -- lifecycle -----------------------------------------------------------------
    def stop(self, *_: object) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def end_when_stuck(self) -> None:
        """For a processor that is a process of its own: a transactional call stuck past its deadline ends the
        process (:class:`Watchdog`), so that its restart recovers."""
        self._watchdog = Watchdog(self.processor.name)


    def run(self, max_batches: int | None = None) -> None:
        cfg = self.config
        self.processor.setup()
        if self.freeze_heap:
            gc.freeze()
        self.outbox.start()
        self.consumer.subscribe(list(cfg.inputs), on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_revoke)
        self.log.info("%s consuming %s as group %s (%s, %s assignment)", self.processor.name, ",".join(cfg.inputs),
                      cfg.group_id, "exactly-once" if cfg.exactly_once else "at-least-once", cfg.strategy(self.processor))
        pipelined = self.processor.pipelined
        headers_of = MessageHeaders if self.processor.lazy_headers else _headers_now
        batches = 0
        try:
            while not self._stop.is_set() and (max_batches is None or batches < max_batches):
                if self._writing is not None and self._writing.written.done():
                    self._settle()  # the side effects are written: the offsets of their batches are committed now
                busy = self._pending is not None or bool(self._submitted)  # work in flight: nothing waited for
                messages = self._fetch(busy)
                records = [Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), headers_of(m),
                                  m.timestamp()[1]) for m in messages if m.error() is None or self._usable(m)]
                if self._rewound:  # sought back inside this consume (a revocation): what it brought is read again
                    rewound, self._rewound = self._rewound, {}
                    records = [r for r in records if (r.topic, r.partition) not in rewound]
                    self.backpressure.rewind(rewound)
                if not records and not busy:
                    if self._writing is not None:  # nothing came while they were written
                        self._settle()
                        continue
                    if self.offsets.refused:
                        self.offsets.commit_again()
                    if outputs := self.processor.idle():
                        self._complete(self._send(outputs, [], []))
                    continue
                if records:
                    started = time.perf_counter()
                    try:  # a pipelined processor's service call goes out now
                        finish = self.processor.submit(records)
                    except BackpressureError as exc:
                        self._put_back(records, exc)
                        continue
                    self._submitted.append(_Submitted(records, finish, started))
                if self._pending is not None:
                    self._complete_pending()  # the batch before: acks, side effects, commit
                if not self._submitted or (pipelined and records and len(self._submitted) < 2):
                    continue  # a pipelined processor keeps one batch submitted while the next is fetched
                batch = self._submitted.popleft()
                try:
                    outputs = batch.finish()
                except BackpressureError as exc:
                    self._put_back(batch.records, exc)
                    continue
                self.backpressure.progressed()
                RECORDS_IN.labels(self.processor.name).inc(len(batch.records))
                sent = self._send(outputs, self._positions(batch.records), batch.records, batch.started)
                if pipelined:
                    self._pending = sent
                else:
                    self._complete(sent)
                batches += 1
        finally:
            self.close()

    def _fetch(self, busy: bool) -> list[Message]:
        """The next batch's messages (natural batching, see the module's doc).

        ``busy`` (batches in flight): only what is fetched already, never a wait with work at hand.
        Otherwise up to ``max_wait_ms`` for a first message, then up to ``linger_ms`` for more. One
        ``consume(batch_size, max_wait_ms)`` would hold a lone record for all of ``max_wait_ms``. Nothing
        at hand ends the open delivery before the wait for a first message (a quiet stream's batches are
        acknowledged and committed at once). While side effects are written, that wait lasts no longer
        than the write (the loop then commits what it waited for).
        """
        cfg = self.config
        consume = self.consumer.consume
        self._revoked.clear()
        messages = consume(cfg.batch_size, 0)
        if busy:
            return messages
        if not messages:
            self._end_delivery()  # nothing more at hand: acks, side effects and commit now
        if not messages and self._writing is not None:
            # a revocation served inside this poll settles the write (``_on_revoke``): the wait ends with it
            while not messages and self._writing is not None and not self._writing.written.done() \
                    and not self._stop.is_set():
                messages = consume(1, WRITING_POLL_S)
        elif not messages:
            messages = consume(1, cfg.max_wait_ms / 1000)
        wanted = cfg.batch_size - len(messages)
        if not messages or wanted <= 0 or not self._linger_s:
            return messages
        more = consume(wanted, self._linger_s)
        if self._revoked:  # a rebalance served while lingering: what came before from those partitions is stale
            messages = [m for m in messages if (m.topic(), m.partition()) not in self._revoked]
        messages.extend(more)
        return messages

    def close(self) -> None:
        try:
            if self._pending is not None:
                self._complete_pending()
            self._end_delivery()
            self._settle()
        except (DeliveryError, KafkaException) as exc:
            self.log.warning("the last batch was not committed, it will be read again: %s", exc)
        try:
            self.processor.close()
        finally:
            self.outbox.close()
            self.offsets.commit_sync()
            self.consumer.close()
            self.log.info("%s stopped", self.processor.name)

    # -- backpressure ------------------------------------------------------------------
    def _flush_side_effects(self, wait: bool = True) -> Future | None:
        """``processor.flush`` (side effects outside Kafka), after the outputs' acks and before the commit.

        ``wait=False``: a flush written in the processor's own thread returns its future at once (the caller
        commits when it is done, :meth:`_settle`); otherwise this returns once the side effects are written.

        A service it writes to being down (:class:`BackpressureError`, e.g. the online store's circuit
        breaker open) does not block the loop: every partition is paused and the loop keeps polling
        (the group never rebalances) while it backs off, asks ``ready()`` and tries the flush again. The
        batch's outputs are acknowledged already; its offsets wait for the side effects, so nothing is
        lost and nothing is read twice. In exactly-once mode the wait is bounded by the open
        transaction's timeout: past 80 % of it the transaction is aborted and the processor stops
        (:class:`DeliveryError`), and a restart rebuilds from the committed offsets.
        """
        try:
            if not wait:
                return self.processor.flush()
            self._flush_now()
        except BackpressureError as exc:
            self._write_side_effects(exc)
        return None

    def _flush_now(self) -> None:
        """``processor.flush``, and the end of its write when it writes in a thread of its own."""
        if (written := self.processor.flush()) is not None:
            written.result()

    def _write_side_effects(self, reason: BackpressureError) -> None:
        """The side effects failed with ``reason``: paused until they are written
        (:meth:`Backpressure.write_side_effects`); exactly-once, the transaction is aborted when they are not
        written in time."""
        try:
            self.backpressure.write_side_effects(reason, self._flush_now)
        except DeliveryError:
            if self.config.exactly_once:
                self.outbox.abort()
            raise

    def _settle(self) -> None:
        """Wait for the side effects being written (backpressure while they fail), then commit their batches."""
        if self._writing is None:
            return
        writing, self._writing = self._writing, None
        try:
            writing.written.result()
        except BackpressureError as exc:
            self._write_side_effects(exc)
        self._commit_delivered(writing.batches)

    def _put_back(self, records: list[Record], reason: BackpressureError) -> None:
        """Backpressure: the batch produced before is completed, ``records`` and every batch submitted
        after them are put back (their results, if any, are dropped: nothing of them was produced)."""
        if self._pending is not None:
            self._complete_pending()
        self._end_delivery()  # not left open through the back-off
        self._settle()
        later = [r for batch in self._submitted for r in batch.records]
        self._submitted.clear()
        self.backpressure.put_back([*records, *later], reason)

    def _drop_in_flight(self, records: list[Record], revoked: frozenset | set = frozenset()) -> None:
        """Read ``records`` and every batch submitted and not produced again: seek their partitions (those not
        ``revoked``) back to the first of them. Inside a rebalance callback the consume call that runs it
        may bring records fetched before the seek: the loop drops those and seeks again."""
        first = first_offsets(itertools.chain(records, *(batch.records for batch in self._submitted)))
        self._submitted.clear()
        kept = {tp: offset for tp, offset in first.items() if tp not in revoked}
        self.backpressure.rewind(kept)
        if self._in_callback:
            for tp, offset in kept.items():
                self._rewound[tp] = min(self._rewound.get(tp, offset), offset)

    # -- the guarantee ---------------------------------------------------------------
    def _send(self, outputs: list[Output], offsets: list[TopicPartition], records: list[Record],
              started: float = 0.0) -> "_Sent":
        """Produce ``outputs`` (in the open transaction in exactly-once mode); :meth:`_complete` finishes the batch."""
        if not self._open:  # a new delivery (a pipelined processor's batch before it was delivered already)
            self.outbox.begin()
        self.outbox.send(outputs)
        return _Sent(outputs, offsets, records, started)

    def _complete_pending(self) -> None:
        sent, self._pending = self._pending, None
        self._complete(sent)

    def _complete(self, sent: "_Sent") -> None:
        """Add a produced batch to the open delivery, which ends when it is due (``commit_interval_ms``)."""
        if not self._open:
            self._open_ends = time.monotonic() + self.config.commit_interval_ms / 1000
        self._open.append(sent)
        if time.monotonic() >= self._open_ends:
            self._end_delivery()

    def _end_delivery(self) -> None:
        """Deliver the open delivery's batches, if any: acks, side effects, commit (exactly-once: its transaction)."""
        if self._open:
            batches, self._open = self._open, []
            self._deliver(batches)

    def _deliver(self, batches: list["_Sent"]) -> None:
        """Wait for every ack of the batches' outputs, run side effects, then commit their offsets
        (in exactly-once mode: send them to the transaction and commit it). At-least-once, side effects
        written in the processor's own thread are left to it: the batches' commit waits for them
        (:meth:`_settle`), the next batch does not."""
        transactional = self.config.exactly_once
        self.outbox.acknowledged()
        self._settle()  # the batches before: their side effects and commit come first
        if (written := self._flush_side_effects(wait=transactional)) is not None:
            self._writing = _Writing(written, batches)
            return
        self._commit_delivered(batches)

    def _commit_delivered(self, batches: list["_Sent"]) -> None:
        """Commit the offsets of batches whose outputs are acknowledged and side effects written."""
        transactional = self.config.exactly_once
        offsets = self.offsets.owned_of(tp for sent in batches for tp in sent.offsets)
        if transactional:
            # The broker aborts a transaction open longer than its timeout: no use waiting longer for either call.
            # librdkafka may block past the timeout it is given when the group coordinator went away (a broker
            # restart: librdkafka issues 5456, 5511); the watchdog ends such a process, whose restart fences
            # this transaction and reads its batches again.
            wait_s = self.config.transaction_timeout_s
            try:
                with Watchdog.deadline(self._watchdog, 2 * wait_s + 5, "committing a transaction"):
                    self.outbox.commit(offsets, self.consumer.consumer_group_metadata(), wait_s)
            except KafkaException as exc:
                if not exc.args[0].txn_requires_abort():
                    raise  # fenced or fatal: the process stops, a restart reads the batches again
                self.outbox.abort()
                records = [r for sent in batches for r in sent.records]
                if not (self.processor.pipelined and records):
                    # State built from the batches (windows) would count them twice if they were read again here:
                    # the processor stops, and a restart rebuilds its state from the committed offsets.
                    raise DeliveryError(f"{self.processor.name}: transaction aborted, offsets not committed: "
                                        f"{exc.args[0].str()}") from exc
                # Typically the group moved to a new generation (a rebalance) while the batches were in flight:
                # their outputs are discarded and their records, and those of the batches after them, read again.
                TRANSACTIONS_ABORTED.labels(self.processor.name).inc()
                self.log.warning("%s: transaction aborted, %d records read again: %s", self.processor.name,
                                 len(records), exc.args[0].str())
                self._drop_in_flight(records)
                return
        else:
            self.offsets.commit(offsets)  # asynchronous: the outputs are acknowledged already
        name = self.processor.name
        for sent in batches:
            for topic, n in collections.Counter(out.topic for out in sent.outputs).items():
                RECORDS_OUT.labels(name, topic).inc(n)
            for out in sent.outputs:
                if "dlq.reason" in out.headers:
                    DEAD_LETTERS.labels(name, str(out.headers["dlq.reason"])).inc()
            if sent.records:
                BATCH_SECONDS.labels(name).observe(time.perf_counter() - sent.started)
                self._observe_latency(sent.records)
        self.offsets.observe_lag(offsets)

    def _observe_latency(self, records: list[Record], sample: int = 4) -> None:
        """Ingest-to-commit latency of up to ``sample`` records of the batch, evenly spaced."""
        now_ms = time.time() * 1000
        histogram = INGEST_TO_COMMIT.labels(self.processor.name)
        for record in records[:: max(1, len(records) // sample)]:
            ingest = record.headers.get(H_INGEST_MS)
            if ingest:
                histogram.observe(max(0.0, now_ms - int(ingest)) / 1000)

    def _positions(self, records: Iterable[Record]) -> list[TopicPartition]:
        """Next offset to read per partition, held back to what stateful processors still need."""
        # one consume() brings each partition's records in offset order: the last one seen is the highest
        last = {(r.topic, r.partition): r.offset for r in records}
        positions = []
        for (topic, partition), offset in last.items():
            tp = TopicPartition(topic, partition)
            needed = self.processor.committable(tp)
            positions.append(TopicPartition(topic, partition, offset + 1 if needed is None else min(needed, offset + 1)))
        return positions

    def _usable(self, msg: Message) -> bool:
        err = msg.error()
        if err is None:
            return True
        if err.code() == KafkaError._PARTITION_EOF:
            return False
        if err.fatal():
            raise KafkaException(err)
        self.log.warning("consumer error: %s", err.str())
        return False

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.assignments += 1
        self.offsets.assigned(partitions)
        self.log.info("partitions assigned: %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "none")

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.log.info("partitions revoked: %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))
        self._revoked.update((p.topic, p.partition) for p in partitions)
        self._in_callback = True  # seeks made now are repeated after the consume that runs this callback
        try:
            if self._pending is not None:  # its transaction and offsets belong to the generation ending now
                self._complete_pending()
            self._end_delivery()
            self._settle()  # side effects being written: their offsets are committed before the partitions go
        except DeliveryError as exc:
            self.log.warning("the batch in flight was not committed, the new owner reads it again: %s", exc)
        try:
            # nothing of the batches submitted is produced: read again, here or by the partitions' new owners
            self._drop_in_flight([], revoked={(p.topic, p.partition) for p in partitions})
        finally:
            self._in_callback = False
        self.offsets.release(partitions)
        self.processor.on_revoke(partitions)
