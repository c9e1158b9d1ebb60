"""The rule processor (seed node 4): predictions and feature windows → explainable actions.

Inputs: the prediction topic(s) and, for degradation, the feature-window topic (a topic whose
schema has ``model_name`` carries predictions; any other carries feature windows). A decision is
about one entity at one time: the declared ``entity_field`` and ``time_field`` of the records
(``device_id`` and ``window_end`` in the reference app). Per micro-batch, at the level in effect:

* **L0 / L1**: each prediction (or each fused group of predictions, see :mod:`streams.rules.fusion`)
  is evaluated by the rules of that level with the entity's online features (Redis); at L1 the
  ``expensive`` fusion members are not waited for;
* **L2**: each feature window is evaluated by the L2 rules — features only, no model;
* **L3**: each feature window yields the declared safe default.

Of the matching rules of one action type, the highest-priority one fires (:mod:`streams.rules.evaluation`);
a cooldown per entity and action type (event time) and a per-window dedup hold back repeats, and one entity window is
decided on one path: a window decided without the model is not decided again by a late
prediction, and the other way round (:mod:`streams.rules.memory`). Every action names the rule,
its inputs, the model versions, the rule-set version and the level in effect, with a
deterministic ``event_id``, and carries every other field its schema shares with the record it
decided on (:mod:`streams.rules.actions`).

Live config (``ConfigSubscriber``): ``business-rule/<rule_set>`` replaces the topology's rules
and ``feature-switch/degradation.level`` is the manual level; both apply at the next micro-batch
(the processor polls every ``max_wait_ms``), without a restart. A whole batch is decided by one
rule-set version.

Failures: the online-feature reads go through the processor's Redis guard (:mod:`streams.resilience`:
the declared deadline, retries, circuit breaker). They are made for the whole batch before any state
changes, so when Redis is down the batch is put back whole (backpressure: partitions paused, polling
on, nothing lost) and decided once Redis answers. A rule that cannot be evaluated on a record (a
mistyped input) sends that record to the DLQ with reason ``rule_unevaluable`` — ``rule_missing_input``
when an input it reads has no value (e.g. no online features for the entity yet) — naming the rule and
why; the record's other rules still decide.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from collections.abc import Mapping
from typing import Any

from confluent_kafka import TopicPartition
from prometheus_client import Counter, Gauge

from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.context import BuildContext
from streams.delivery import Output, Processor, Record, dead_letter
from streams.errors import ServiceUnavailableError, TangramError, TopologyError
from streams.features.layout import FeastLayout
from streams.features import online_layout
from streams.rules.degradation import GoldenSignals, LevelController
from streams.rules.actions import Actions
from streams.rules.engine import RuleBook
from streams.rules.evaluation import Evaluation, Inputs
from streams.rules.fusion import Fused, Fusion
from streams.rules.memory import DecisionMemory
from streams.rules.online_reads import OnlineReads
from streams.resilience import REDIS_FAILURES, Guard
from streams.rules.spec import Level, RuleSpec, RuleSetValue, RulesSettings
from streams.security.kafka import KafkaConnection

log = logging.getLogger("tangram.rules")

RULE_SET_VERSION = Gauge("tangram_rules_rule_set_version", "Config version of the rule set in effect (0: the topology's).",
                         ["processor"])
RELOADS = Counter("tangram_rules_reloads_total", "Rule-set changes from the config center, by outcome.",
                  ["processor", "outcome"])
FUSIONS = Counter("tangram_rules_fusions_total", "Fused groups, by outcome (complete, partial, too_few).",
                  ["processor", "outcome"])
SKIPPED = Counter("tangram_rules_skipped_total", "Records not decided, by why (decided_other_path, late_member, level).",
                  ["processor", "why"])


class RuleProcessor(Processor):
    """Predictions (+ feature windows) → ``Action`` records on the action topics."""

    name = "rules"
    services = frozenset({"redis", "registry"})
    pipelined = True  # a batch's online-store read overlaps the delivery of the batch before
    lazy_headers = True  # the headers of the predictions that fire

    def __init__(self, *, input_codecs: dict[str, AvroCodec], output_codecs: dict[str, AvroCodec], dlq_topic: str,
                 redis_url: str, settings: RulesSettings, app: str, processor: str = "rules",
                 kafka: KafkaConnection | None = None, online: FeastLayout | None = None,
                 redis_guard: Guard | None = None):
        self.name = processor
        self.input_codecs = input_codecs
        self.prediction_topics = {t for t, c in input_codecs.items() if _has_field(c, "model_name")}
        # what a prediction carries itself: a rule reading only these needs no online-store read
        self.prediction_fields = frozenset(f.get("name") for t in self.prediction_topics
                                           for f in input_codecs[t].schema_json.get("fields", []))
        if not self.prediction_topics:
            raise TopologyError(f"rule processor {processor!r}: no input carries predictions (a `model_name` field)")
        self.output_codecs = output_codecs
        self.dlq_topic = dlq_topic
        self.settings = settings
        self.entity, self.time = settings.entity_field, settings.time_field
        self.app = app
        self.kafka = kafka
        try:
            self.topics = settings.topics(list(output_codecs))  # action type or topic → topic
            self.safe_topic = settings.safe_topic(list(output_codecs))
        except TopologyError as exc:
            raise TopologyError(f"rule processor {processor!r}: {exc}") from None
        self.book = RuleBook.build(settings.rules, "topology", 0, self.topics)
        self.actions = Actions(self.entity, self.time, input_codecs, output_codecs, settings.fusion)
        spec = settings.degradation
        self.rule_set_key = settings.rule_set or f"{app}.{processor}"
        # reads of the features processor's rows in Feast's Redis layout (its feature set, its Feast project)
        self.online = OnlineReads(processor, redis_url, online, self.prediction_fields, redis_guard,
                                  settings.online_wait_ms) if online is not None else None
        self.signals = GoldenSignals(spec)
        self.levels = LevelController(spec, processor, settings.degradation_level)
        self.fusion = Fusion(settings.fusion, lambda p: (p[self.entity], p[self.time])) if settings.fusion else None
        self.memory = DecisionMemory()  # one path per entity window; repeats and cooldowns
        self.evaluation = Evaluation(processor, settings, self.actions, self.memory, self.online, self._read_online,
                                     self.prediction_fields, dlq_topic, self.safe_topic)
        self._lock = threading.Lock()
        self._next_book: RuleBook | None = None
        self._next_manual: Level | None = None
        self.config = None
        self._rule_value: Any = None  # the config center's value of the rule set now in effect
        RULE_SET_VERSION.labels(processor).set(0)

    @classmethod
    def build(cls, ctx: BuildContext) -> RuleProcessor:
        settings = ctx.settings(RulesSettings)
        online = online_layout(ctx.topology, settings.features_from) if settings.features_from else None
        return cls(input_codecs={t: ctx.codec(t) for t in ctx.spec.inputs},
                   output_codecs={t: ctx.codec(t) for t in ctx.spec.outputs}, dlq_topic=ctx.dlq,
                   redis_url=ctx.stack.redis_url, settings=settings,
                   app=ctx.topology.app, processor=ctx.name, kafka=ctx.stack.kafka,
                   online=online, redis_guard=ctx.calls.guard("redis", REDIS_FAILURES))

    # -- lifecycle ---------------------------------------------------------------------
    def setup(self) -> None:
        if self.online is not None:
            self.online.setup()
        if self.settings.live_config and self.kafka:
            from streams.config_center import ConfigSubscriber
            from streams.statelog import StateTopic

            StateTopic(self.kafka, self.settings.config_topic).ensure()  # a fresh stack has none yet
            self.config = ConfigSubscriber(self.kafka, self.settings.config_topic, name=self.name,
                                           namespaces=["business-rule", "feature-switch"])
            self.config.on_change(lambda applied: self._on_config(applied.version))
            self.config.start()
            self._on_config(self.config.version)
            self._refresh()
        log.info("%s: rule set %s (%d rules), level %s", self.name, self.book.source, len(self.book.rules),
                 self.levels.level)

    def ready(self) -> bool:
        """After a backpressure: whether Redis answers (no call while its breaker is open)."""
        return self.online is None or self.online.ready()

    def close(self) -> None:
        if self.config is not None:
            self.config.stop()
        if self.online is not None:
            self.online.close()

    def committable(self, partition: TopicPartition) -> int | None:
        return self.fusion.committable(partition.topic, partition.partition) if self.fusion else None

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        if self.fusion:
            self.fusion.drop({(p.topic, p.partition) for p in partitions})

    @property
    def level(self) -> Level:
        return self.levels.level

    # -- live config -------------------------------------------------------------------
    def _on_config(self, version: int) -> None:
        """In the subscriber's thread: prepare the new rule book and manual level; swapped in at the next batch."""
        assert self.config is not None
        value = self.config.get("business-rule", self.rule_set_key)
        manual = self.config.get("feature-switch", self.settings.degradation.switch, self.settings.degradation_level)
        book = None
        if value != self._rule_value:
            changes = self.config.state.changes_of("business-rule", self.rule_set_key)
            last = changes[-1] if changes else None
            at = last.version if last else version
            try:
                if value is not None:
                    book = RuleBook.build(RuleSetValue.model_validate(value).rules, f"config v{at}", at, self.topics)
                else:  # the override was deleted: back to the topology's rules
                    book = RuleBook.build(self.settings.rules, "topology", 0, self.topics)
                self._rule_value = value
                if last is not None:
                    log.info("%s: business-rule/%s changed in config v%d by %s at %d (%s)", self.name,
                             self.rule_set_key, at, last.change.author, last.change.at_ms, last.change.reason or "no reason")
            except (TangramError, ValueError) as exc:
                RELOADS.labels(self.name, "refused").inc()
                log.error("%s: rule set business-rule/%s of config v%d refused, keeping %s: %s", self.name,
                          self.rule_set_key, at, self.book.source, exc)
        with self._lock:
            if book is not None:
                self._next_book = book
            self._next_manual = manual

    def _refresh(self) -> None:
        with self._lock:
            book, manual = self._next_book, self._next_manual
            self._next_book = self._next_manual = None
        if book is not None:
            log.info("%s: rule set %s → %s (%d rules)", self.name, self.book.source, book.source, len(book.rules))
            self.book = book
            if self.online is not None:
                self.online.forget()
            RELOADS.labels(self.name, "applied").inc()
            RULE_SET_VERSION.labels(self.name).set(book.version)
        if manual is not None and manual != self.levels.manual:
            self.levels.set_manual(manual)

    # -- the hot path ------------------------------------------------------------------
    def process(self, batch: list[Record]) -> list[Output]:
        return self.submit(batch)()

    def submit(self, batch: list[Record]) -> functools.partial:
        """Decode the batch and send its online-store read (in the reader thread, so that Redis answers while the
        loop delivers the batch before); the returned call decides it. Nothing changes state until then."""
        self._refresh()
        outputs: list[Output] = []
        predictions, windows = self._split(batch, outputs)
        pending = None
        if predictions.entities and self.online is not None:
            pending = self.online.submit(self._read_online, predictions.entities)
        return functools.partial(self._decide, batch, self.book, outputs, predictions, windows, pending)

    def _decide(self, batch: list[Record], book: RuleBook, outputs: list[Output], predictions: Inputs,
                windows: Inputs, pending: Future | None) -> list[Output]:
        self._refresh()
        if self.book is not book:  # the rule set changed after the batch was decoded for the one before
            return self.process(batch)
        # Redis first, before any state changes: when it is down the batch is put back whole (backpressure)
        online = pending.result() if pending is not None else {}
        if fused := [e for e in self._fusion_pending() if e not in online]:  # groups that waited since: read too
            online = self._read_online(predictions.entities + fused)
        if self.online is not None:
            online = self.online.wait_for_rows(online, self._read_online)
        self.signals.predictions(predictions.entities, predictions.times, predictions.inference_ms)
        for entity, end in zip(windows.entities, windows.times):
            self.signals.window(entity, end)
        level = self.levels.update(self.signals.values())
        if level in ("L0", "L1"):
            outputs += self._decide_predictions(predictions, level, online)
        else:
            if predictions.records:
                SKIPPED.labels(self.name, "level").inc(len(predictions.records))
            outputs += self._decide_windows(windows, level)
        outputs += self._expire(level, online)
        return outputs

    def _split(self, batch: list[Record], outputs: list[Output]) -> tuple[Inputs, Inputs]:
        """The batch's predictions and feature windows (an undecodable record is dead-lettered into ``outputs``)."""
        predictions: list[Record] = []
        windows: list[Record] = []
        for record in batch:
            (predictions if record.topic in self.prediction_topics else windows).append(record)
        rules = (*self.book.at("L0"), *self.book.at("L1"))
        wanted = {self.entity, self.time, "inference_ms", *self.evaluation.action_reads, *(s for r in rules for s in r.symbols)}
        return self._inputs(predictions, wanted, outputs), self._inputs(windows, {self.entity, self.time}, outputs)

    def _inputs(self, records: list[Record], wanted: set[str], outputs: list[Output]) -> Inputs:
        """``records`` decoded a batch at a time (the ``wanted`` fields as columns) when they are of one topic
        and its batch codec reads them all; else record by record, each undecodable one to the DLQ."""
        topics = {r.topic for r in records}
        if len(topics) == 1:
            codec = self.input_codecs[next(iter(topics))]
            if isinstance(codec, AvroCodec) and codec.batch is not None:  # Avro, a flat record
                fields = [f["name"] for f in codec.schema_json["fields"] if f["name"] in wanted]
                columns = codec.batch.decode([r.value for r in records], only=fields)
                if columns is not None:
                    return Inputs(records, [None] * len(records), columns, self.entity, self.time, self.input_codecs)
        kept, values = [], []
        for record in records:
            try:
                values.append(self.input_codecs[record.topic].decode(record.value))
            except (WireFormatError, ValueError, EOFError, KeyError, TypeError) as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                continue
            kept.append(record)
        return Inputs(kept, values, None, self.entity, self.time, self.input_codecs)

    def idle(self) -> list[Output]:
        self._refresh()
        try:
            online = self._read_online(self._fusion_pending())
        except ServiceUnavailableError as exc:  # the groups wait for Redis, nothing of them is decided without it
            log.warning("%s: fused groups not expired while the online store is unavailable: %s", self.name, exc)
            return []
        return self._expire(self.levels.update(self.signals.values()), online)

    def _fusion_pending(self) -> list[str]:
        """The entities of the predictions waiting in fusion groups (decided from the online features when they expire)."""
        if self.fusion is None:
            return []
        return [entity for entity, _ in self.fusion.groups]

    def _read_online(self, entities: list[str]) -> Mapping[str, dict]:
        """The online features of ``entities`` (one read) that the rules of the levels deciding with them (L0, L1)
        read."""
        if self.online is None:
            return {}
        return self.online.read(entities, tuple(dict.fromkeys((*self.book.at("L0"), *self.book.at("L1")))))

    def _expire(self, level: Level, online: Mapping[str, dict]) -> list[Output]:
        if self.fusion is None or not self.fusion.groups:
            return []
        fused = self.fusion.expire(cheap_only=level != "L0")
        if level not in ("L0", "L1"):
            SKIPPED.labels(self.name, "level").inc(len(fused))
            return []
        return self._decide_fused(fused, level, online)

    def _decide_predictions(self, predictions: Inputs, level: Level, online: Mapping[str, dict]) -> list[Output]:
        todo = self._not_decided_otherwise(predictions, by_model=True)
        if self.fusion is not None:
            fused: list[Fused] = []
            for i in todo:
                fused += self.fusion.add(predictions.records[i], predictions.value(i), cheap_only=level != "L0")
            return self._decide_fused(fused, level, online)
        if predictions.columns is None or not all(r.vectorised for r in self.book.at(level)):
            return self.evaluation.evaluate(self.book, level, [(predictions.records[i], predictions.value(i), ())
                                                               for i in todo], online, with_online=True)
        return self.evaluation.evaluate_columns(self.book, level, predictions, todo, online)

    def _decide_fused(self, fused: list[Fused], level: Level, online: Mapping[str, dict]) -> list[Output]:
        items = []
        for f in fused:
            if not f.prediction:
                FUSIONS.labels(self.name, "too_few").inc()
                log.warning("%s: fusion of %s@%s had too few members (missing %s)", self.name,
                            f.records[0].key if f.records else "?", f.records[0].where if f.records else "?",
                            ", ".join(f.missing))
                continue
            FUSIONS.labels(self.name, "partial" if f.missing else "complete").inc()
            items.append((f.records[0], f.prediction, f.missing))
        return self.evaluation.evaluate(self.book, level, items, online, with_online=True)

    def _decide_windows(self, windows: Inputs, level: Level) -> list[Output]:
        todo = self._not_decided_otherwise(windows, by_model=False)
        if level == "L3":
            return [o for i in todo
                    if (o := self.evaluation.safe_default(windows.records[i], windows.value(i))) is not None]
        return self.evaluation.evaluate(self.book, level, [(windows.records[i], windows.value(i), ()) for i in todo],
                                        {}, with_online=False)

    def _not_decided_otherwise(self, inputs: Inputs, by_model: bool) -> list[int]:
        """The indexes of ``inputs`` to decide: each (entity, window end) is remembered with how it is decided,
        and one already decided on the other path (by the model, or from the window alone) is skipped."""
        todo, skipped = self.memory.claim(zip(inputs.entities, inputs.times), by_model)
        if skipped:
            SKIPPED.labels(self.name, "decided_other_path").inc(skipped)
        return todo


def _has_field(codec: AvroCodec, name: str) -> bool:
    return any(f.get("name") == name for f in codec.schema_json.get("fields", []))


__all__ = ["RuleProcessor", "RuleSpec"]
