"""The simulator seam: an app's events with known ground truth, for the runtime's tools to drive it with.

``tangram demo``, ``tangram verify``, replays and backtests, and the end-to-end benchmarks run any
app the same way: they start its processors, produce what its simulator makes, read back what
came out of the topics, and let the simulator score it against its ground truth. An app declares
its simulator in its topology (optional: an app without one still plans, applies, runs and
deploys)::

    simulator:
      kind: pm_app.simulator:FleetSimulator   # a Simulator, from the app's plugin code
      source: pm.raw.telemetry                # where the simulated producers write
      truth: pm.sim.labels                    # where it writes its ground truth (optional)
      table: pm.devices                       # where it writes its entities' table (optional)
      params: {hz: 10.0}                      # validated by the simulator's own Settings

A simulator is a plain class: :meth:`Simulator.tick` makes the events of one time step of every
simulated entity, :meth:`Simulator.score` judges what the pipeline did with them, and the three
verify hooks give step 1 (a valid and a malformed event), step 3 (an incident that must reach the
SLA's sink) and step 4 (a fleet of valid events at a declared rate). :meth:`Simulator.table` gives the
versions of the simulated entities' table over a run (a device registered, taken out of service, moved):
each is produced before the run with its Kafka timestamp at the time it takes effect, so an event-time
join (``enrichment:`` of a feature set) sees each version from then on, live or replayed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from confluent_kafka import Producer
from pydantic import BaseModel, ConfigDict, ValidationError
from rich.table import Table

from streams.avro import codec
from streams.errors import StackError, TopologyError
from streams.settings import StackSettings
from streams.topology import Topology


class SimulatorSettings(BaseModel):
    """Base of a simulator's settings: the ``simulator.params`` of the topology, typed and frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class Event:
    """One simulated record for the source topic. ``event_id`` is set for a valid event (the id the
    ingest stage carries on), empty for one that is meant to be refused."""

    key: str
    value: bytes
    event_id: str = ""


@dataclass(frozen=True)
class DeadLetter:
    topic: str
    key: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class TableVersion:
    """One version of an entity in the simulator's table: its value (None: a tombstone) from ``at_ms`` on."""

    key: str
    value: dict | None
    at_ms: int


@dataclass
class Observed:
    """What a run produced, read back from the topics, for the simulator to score."""

    start_ms: int
    truth: list[dict] = field(default_factory=list)  # the ground truth records of the run
    actions: list[dict] = field(default_factory=list)  # decoded actions of the rule processors, each with "_topic"
    predictions: list[dict] = field(default_factory=list)  # decoded predictions (backtests)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    #: records the stages filtered out as declared (a feature set's ``keep``), "<attribute>=<value>" → count,
    #: from their metrics (nothing of them is on a topic)
    filtered: dict[str, int] = field(default_factory=dict)
    #: the model cards of the app's models as the stack serves them (``<model>/model_card.json`` in its model
    #: repository), model → card: what the app's training measured, for the scoreboard to show beside the run
    model_cards: dict[str, dict] = field(default_factory=dict)


@dataclass
class Scoreboard:
    """A simulator's verdict on a run: tables to print, and named figures to compare runs and versions by."""

    tables: list[Table] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Simulator(ABC):
    """An app's source of events with ground truth (see the module's doc)."""

    #: The simulator's settings model; ``simulator.params`` of the topology are validated by it.
    Settings: ClassVar[type[SimulatorSettings]] = SimulatorSettings

    def __init__(self, topology: Topology, settings: SimulatorSettings, *, entities: int, seed: int):
        self.topology = topology
        self.settings = settings
        self.entities = entities
        self.seed = seed

    @classmethod
    def build(cls, topology: Topology, *, entities: int = 20, seed: int = 7) -> Self:
        """The simulator of ``topology``'s app with ``entities`` simulated entities."""
        params = topology.simulator.params if topology.simulator else {}
        try:
            settings = cls.Settings.model_validate(params)
        except ValidationError as exc:
            raise TopologyError(f"app {topology.app!r}: simulator params: {exc}") from exc
        return cls(topology, settings, entities=entities, seed=seed)

    # -- events ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def rate_hz(self) -> float:
        """Time steps per second of event time (one :meth:`tick` each)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the operator: what is simulated (entities, rate, injected faults)."""

    @abstractmethod
    def tick(self, step: int, start_ms: int) -> list[Event]:
        """The events of time step ``step`` (at ``start_ms + step / rate_hz`` seconds) of every entity."""

    def truth(self, start_ms: int) -> list[tuple[str, dict]]:
        """The ground truth of a run starting at ``start_ms``: (key, record) for the ``truth`` topic (Avro)."""
        return []

    def table(self, start_ms: int) -> list[TableVersion]:
        """The versions of the simulated entities' table over a run starting at ``start_ms`` (for ``table``)."""
        return []

    @abstractmethod
    def score(self, observed: Observed) -> Scoreboard:
        """What the pipeline did with the simulated events, judged against the ground truth."""

    # -- verify ----------------------------------------------------------------------------
    @abstractmethod
    def probe(self, now_ms: int) -> tuple[Event, Event, str]:
        """Step 1: a valid event, a malformed one, and the DLQ reason the ingest stage must give the latter."""

    @abstractmethod
    def incident(self, start_ms: int) -> tuple[list[list[Event]], str]:
        """Step 3: the events of one entity from ``start_ms`` on, one list per time step (``rate_hz``), that
        must lead to an action on the SLA's sink, and that entity (the action's key). Verify sends each step
        at its own time, as a live source would: history stamped before ``start_ms`` could be late for a
        partition whose stream time other records (step 1's probe, live traffic) have moved past it."""

    @abstractmethod
    def load(self, entities: int) -> Simulator:
        """Step 4: a simulator of ``entities`` entities whose every event is valid, some leading to actions."""


def build_simulator(topology: Topology, *, entities: int = 20, seed: int = 7) -> Simulator:
    """The app's own simulator class (its plugin code), built for ``entities`` entities."""
    if topology.simulator is None:
        raise TopologyError(f"app {topology.app!r} declares no `simulator:`; the demo, verify and backtests need one")
    cls = topology.load_object(topology.simulator.kind)
    if not (isinstance(cls, type) and issubclass(cls, Simulator)):
        raise TopologyError(f"simulator {topology.simulator.kind!r} is not a streams.simulation.Simulator")
    return cls.build(topology, entities=entities, seed=seed)


def producer(stack: StackSettings, **extra: Any) -> Producer:
    """An idempotent producer for simulated records (``acks=all``)."""
    return Producer(stack.kafka.config({"enable.idempotence": True, "acks": "all",
                                        "linger.ms": 5, "compression.type": "lz4", **extra}))


def send_run_context(stack: StackSettings, simulator: Simulator, start_ms: int, out: Producer) -> int:
    """Produce what the simulator says about a run besides its events: its ground truth to its ``truth`` topic
    (keyed by the record's entity) and its entities' table to its ``table`` topic (each version stamped with
    the time it takes effect, a tombstone for a removed entity). Returns the records produced."""
    spec = simulator.topology.simulator
    if spec is None:
        return 0
    sent = 0
    for topic, records in ((spec.truth, [(key, record, None) for key, record in simulator.truth(start_ms)]),
                           (spec.table, [(v.key, v.value, v.at_ms) for v in simulator.table(start_ms)])):
        if topic is None or not records:
            continue
        subject = simulator.topology.topics[topic].schema_
        if subject is None:
            raise TopologyError(f"the simulator's topic {topic!r} needs an Avro schema")
        encoder = codec(stack.registry_url, subject, simulator.topology.schema(subject))
        for key, value, at_ms in records:
            out.produce(topic, None if value is None else encoder.encode(value), key,
                        **({"timestamp": at_ms} if at_ms is not None else {}))
        sent += len(records)
    return sent


def run_ticks(simulator: Simulator, out: Producer, duration_s: float, start_ms: int, *, realtime: bool = True,
              timestamps: bool = False) -> Iterator[list[Event]]:
    """Produce ``duration_s`` of the simulator's events to its source topic; yields each step's events.

    ``realtime`` paces the steps on the wall clock (a demo); otherwise they go as fast as the broker takes
    them (history for a backtest, a benchmark). ``timestamps`` gives each record its step's event time as
    its Kafka timestamp, as if it had arrived live then.
    """
    spec = simulator.topology.simulator
    assert spec is not None
    t0 = time.monotonic()
    for step in range(int(duration_s * simulator.rate_hz)):
        if realtime and (delay := t0 + step / simulator.rate_hz - time.monotonic()) > 0:
            time.sleep(delay)
        events = simulator.tick(step, start_ms)
        ts = start_ms + int(step * 1000 / simulator.rate_hz) if timestamps else 0
        for event in events:
            while True:
                try:
                    out.produce(spec.source, event.value, event.key, **({"timestamp": ts} if timestamps else {}))
                    break
                except BufferError:  # the local queue is full: serve delivery reports, then go on
                    out.poll(0.05)
        out.poll(0)
        yield events


def flush(out: Producer, timeout_s: float = 60.0) -> None:
    if out.flush(timeout_s):
        raise StackError(f"simulated records were not all acknowledged by Kafka within {timeout_s:g}s")
