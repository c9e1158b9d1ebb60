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

Of the matching rules of one action type, the highest-priority one fires; a cooldown per entity
and action type (event time) and a per-window dedup hold back repeats, and one entity window is
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
from functools import lru_cache
from typing import Any

import rule_engine
from confluent_kafka import TopicPartition
import numpy as np
from prometheus_client import Counter, Gauge

from streams.avro import AvroCodec
from streams.columnar import MapColumn
from streams.wire import WireFormatError
from streams.context import BuildContext
from streams.delivery import Output, Processor, Record, dead_letter
from streams.errors import ServiceUnavailableError, TangramError, TopologyError
from streams.features.layout import FeastLayout
from streams.features import online_layout
from streams.features.online import OnlineRows
from streams.rules.degradation import GoldenSignals, LevelController
from streams.rules.actions import Actions
from streams.rules.engine import CompiledRule, RuleBook
from streams.rules.fusion import Fused, Fusion
from streams.rules.memory import DecisionMemory
from streams.rules.online_reads import OnlineReads
from streams.resilience import REDIS_FAILURES, Guard
from streams.rules.spec import Level, RuleSpec, RuleSetValue, RulesSettings
from streams.rules.vector import Column, column
from streams.security.kafka import KafkaConnection

log = logging.getLogger("tangram.rules")

FIRED = Counter("tangram_rules_fired_total", "Actions emitted per rule and level.", ["processor", "rule", "level"])
SUPPRESSED = Counter("tangram_rules_suppressed_total", "Firings held back, by why (cooldown, duplicate, priority).",
                     ["processor", "rule", "why"])
UNEVALUABLE = Counter("tangram_rules_evaluation_errors_total", "Rules that could not be evaluated on a record.",
                      ["processor", "rule"])
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
        self.action_reads = self.actions.reads(self.prediction_fields)  # a batch decoded as columns holds them
        spec = settings.degradation
        self.rule_set_key = settings.rule_set or f"{app}.{processor}"
        # reads of the features processor's rows in Feast's Redis layout (its feature set, its Feast project)
        self.online = OnlineReads(processor, redis_url, online, self.prediction_fields, redis_guard,
                                  settings.online_wait_ms) if online is not None else None
        self.signals = GoldenSignals(spec)
        self.levels = LevelController(spec, processor, settings.degradation_level)
        self.fusion = Fusion(settings.fusion, lambda p: (p[self.entity], p[self.time])) if settings.fusion else None
        self.memory = DecisionMemory()  # one path per entity window; repeats and cooldowns
        self._lock = threading.Lock()
        self._next_book: RuleBook | None = None
        self._next_manual: Level | None = None
        self.config = None
        self._rule_value: Any = None  # the config center's value of the rule set now in effect
        self._online: Mapping[str, dict] = {}  # entity → online features, read for the batch being decided
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

    def _decide(self, batch: list[Record], book: RuleBook, outputs: list[Output], predictions: "_Inputs",
                windows: "_Inputs", pending: Future | None) -> list[Output]:
        self._refresh()
        if self.book is not book:  # the rule set changed after the batch was decoded for the one before
            return self.process(batch)
        # Redis first, before any state changes: when it is down the batch is put back whole (backpressure)
        online = pending.result() if pending is not None else {}
        if fused := [e for e in self._fusion_pending() if e not in online]:  # groups that waited since: read too
            online = self._read_online(predictions.entities + fused)
        if self.online is not None:
            online = self.online.wait_for_rows(online, self._read_online)
        self._online = online
        self.signals.predictions(predictions.entities, predictions.times, predictions.inference_ms)
        for entity, end in zip(windows.entities, windows.times):
            self.signals.window(entity, end)
        level = self.levels.update(self.signals.values())
        if level in ("L0", "L1"):
            outputs += self._decide_predictions(predictions, level)
        else:
            if predictions.records:
                SKIPPED.labels(self.name, "level").inc(len(predictions.records))
            outputs += self._decide_windows(windows, level)
        outputs += self._expire(level)
        self._online = {}
        return outputs

    def _split(self, batch: list[Record], outputs: list[Output]) -> tuple[_Inputs, _Inputs]:
        """The batch's predictions and feature windows (an undecodable record is dead-lettered into ``outputs``)."""
        predictions: list[Record] = []
        windows: list[Record] = []
        for record in batch:
            (predictions if record.topic in self.prediction_topics else windows).append(record)
        rules = (*self.book.at("L0"), *self.book.at("L1"))
        wanted = {self.entity, self.time, "inference_ms", *self.action_reads, *(s for r in rules for s in r.symbols)}
        return self._inputs(predictions, wanted, outputs), self._inputs(windows, {self.entity, self.time}, outputs)

    def _inputs(self, records: list[Record], wanted: set[str], outputs: list[Output]) -> _Inputs:
        """``records`` decoded a batch at a time (the ``wanted`` fields as columns) when they are of one topic
        and its batch codec reads them all; else record by record, each undecodable one to the DLQ."""
        topics = {r.topic for r in records}
        if len(topics) == 1:
            codec = self.input_codecs[next(iter(topics))]
            if isinstance(codec, AvroCodec) and codec.batch is not None:  # Avro, a flat record
                fields = [f["name"] for f in codec.schema_json["fields"] if f["name"] in wanted]
                columns = codec.batch.decode([r.value for r in records], only=fields)
                if columns is not None:
                    return _Inputs(self, records, [None] * len(records), columns)
        kept, values = [], []
        for record in records:
            try:
                values.append(self.input_codecs[record.topic].decode(record.value))
            except (WireFormatError, ValueError, EOFError, KeyError, TypeError) as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                continue
            kept.append(record)
        return _Inputs(self, kept, values, None)

    def idle(self) -> list[Output]:
        self._refresh()
        try:
            self._online = self._read_online(self._fusion_pending())
        except ServiceUnavailableError as exc:  # the groups wait for Redis, nothing of them is decided without it
            log.warning("%s: fused groups not expired while the online store is unavailable: %s", self.name, exc)
            return []
        try:
            return self._expire(self.levels.update(self.signals.values()))
        finally:
            self._online = {}

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

    def _expire(self, level: Level) -> list[Output]:
        if self.fusion is None or not self.fusion.groups:
            return []
        fused = self.fusion.expire(cheap_only=level != "L0")
        if level not in ("L0", "L1"):
            SKIPPED.labels(self.name, "level").inc(len(fused))
            return []
        return self._decide_fused(fused, level)

    def _decide_predictions(self, predictions: _Inputs, level: Level) -> list[Output]:
        todo = self._not_decided_otherwise(predictions, by_model=True)
        if self.fusion is not None:
            fused: list[Fused] = []
            for i in todo:
                fused += self.fusion.add(predictions.records[i], predictions.value(i), cheap_only=level != "L0")
            return self._decide_fused(fused, level)
        rules = self.book.at(level)
        if predictions.columns is None or not all(r.vectorised for r in rules):
            return self._evaluate([(predictions.records[i], predictions.value(i), ()) for i in todo], level,
                                  with_online=True)
        return self._evaluate_columns(predictions, todo, rules, level)

    def _decide_fused(self, fused: list[Fused], level: Level) -> list[Output]:
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
        return self._evaluate(items, level, with_online=True)

    def _decide_windows(self, windows: _Inputs, level: Level) -> list[Output]:
        todo = self._not_decided_otherwise(windows, by_model=False)
        if level == "L3":
            return [o for i in todo if (o := self._safe_default(windows.records[i], windows.value(i))) is not None]
        return self._evaluate([(windows.records[i], windows.value(i), ()) for i in todo], level, with_online=False)

    def _not_decided_otherwise(self, inputs: "_Inputs", by_model: bool) -> list[int]:
        """The indexes of ``inputs`` to decide: each (entity, window end) is remembered with how it is decided,
        and one already decided on the other path (by the model, or from the window alone) is skipped."""
        todo, skipped = self.memory.claim(zip(inputs.entities, inputs.times), by_model)
        if skipped:
            SKIPPED.labels(self.name, "decided_other_path").inc(skipped)
        return todo

    @staticmethod
    def _blank(rules: tuple[CompiledRule, ...]) -> dict:
        """Null for every symbol ``rules`` read: a record's context starts from it, so every symbol is present
        (rule-engine's slow path for an unknown symbol computes spelling suggestions first)."""
        return dict.fromkeys((s for r in rules for s in r.symbols), None)

    def _evaluate(self, items: list[tuple[Record, dict, tuple[str, ...]]], level: Level,
                  with_online: bool) -> list[Output]:
        if not items:
            return []
        rules = self.book.at(level)
        online: list[dict] = [{}] * len(items)
        if with_online and self._online_reads(rules) is not None:
            by_entity = self._online  # read for the batch before anything changed (see ``process``)
            unread = list(dict.fromkeys(v[self.entity] for _, v, _ in items if v[self.entity] not in by_entity))
            if unread:  # not expected: every entity decided here was read first
                by_entity = {**by_entity, **self._read_online(unread)}
            online = [by_entity.get(v[self.entity], {}) for _, v, _ in items]
        outputs = []
        blank = self._blank(rules)
        for (record, value, missing), features in zip(items, online):
            context = {**blank, **features, **value}
            fired_types: set[str] = set()
            failed: list[str] = []
            missing_input = False
            for rule in rules:
                try:
                    matched = rule.matches(context)
                except rule_engine.EngineError as exc:
                    _child(UNEVALUABLE, self.name, rule.spec.name).inc()
                    unknown = [s for s in rule.symbols if context.get(s) is None]
                    missing_input = missing_input or bool(unknown)
                    failed.append(f"rule {rule.spec.name!r} ({rule.spec.when}): {exc.message}"
                                  + (f"; no value for {', '.join(unknown)}" if unknown else ""))
                    continue
                if not matched:
                    continue
                if rule.spec.action in fired_types:
                    _child(SUPPRESSED, self.name, rule.spec.name, "priority").inc()
                    continue
                fired_types.add(rule.spec.action)
                if not self._rule_held_back(rule, value[self.entity], value[self.time]):
                    outputs.append(self._fire(rule, record, value, context, level, missing))
            if failed:
                log.warning("%s: %s: %d rule(s) could not be evaluated, to the DLQ: %s", self.name, record.where,
                            len(failed), "; ".join(failed))
                reason = "rule_missing_input" if missing_input else "rule_unevaluable"
                outputs.append(dead_letter(record, self.dlq_topic, self.name, "; ".join(failed), reason))
        return outputs

    def _evaluate_columns(self, predictions: _Inputs, todo: list[int], rules: tuple[CompiledRule, ...],
                          level: Level) -> list[Output]:
        """:meth:`_evaluate` for a batch decoded as columns: every rule over every row at once
        (:mod:`streams.rules.vector`); a row on which no rule holds is done, a row on which some rule is not
        known goes to :meth:`_evaluate`, and the firings of the others are held back or emitted as there."""
        if not todo or not rules:
            return []
        n = len(todo)
        columns = self._rule_columns(predictions, todo, rules)
        verdicts = [rule.matches_batch(columns, n) for rule in rules]
        holds = np.stack([h for h, _ in verdicts])  # rules x rows
        decided = np.stack([k for _, k in verdicts]).all(axis=0)
        reads = self._online_reads(rules) is not None
        # what a firing reads of its prediction: the action's fields and the rules' symbols the prediction carries
        fields = self.action_reads.union(*(r.symbols for r in rules)) & self.prediction_fields
        outputs: list[Output] = []
        for j in np.flatnonzero(holds.any(axis=0) | ~decided).tolist():
            i = todo[j]
            record = predictions.records[i]
            if not decided[j]:
                outputs += self._evaluate([(record, predictions.value(i), ())], level, with_online=True)
                continue
            entity, end = predictions.entities[i], predictions.times[i]
            fired_types: set[str] = set()
            for k in np.flatnonzero(holds[:, j]).tolist():
                rule = rules[k]
                if rule.spec.action in fired_types:
                    _child(SUPPRESSED, self.name, rule.spec.name, "priority").inc()
                    continue
                fired_types.add(rule.spec.action)
                if not self._rule_held_back(rule, entity, end):
                    value = predictions.fields(i, fields)
                    context = {**self._blank(rules), **(self._online.get(entity, {}) if reads else {}), **value}
                    outputs.append(self._fire(rule, record, value, context, level, ()))
        return outputs

    def _rule_columns(self, predictions: _Inputs, todo: list[int], rules: tuple[CompiledRule, ...]) -> dict[str, Column]:
        """The column of every symbol ``rules`` read, over the rows ``todo``: the prediction's field, else the
        entity's online feature (when the rules read the online store), else none (null)."""
        index = np.asarray(todo, dtype=np.int64)
        entities = [predictions.entities[i] for i in todo]
        online = self._online
        features = None
        columns: dict[str, Column] = {}
        for symbol in dict.fromkeys(s for r in rules for s in r.symbols):
            if symbol in predictions.columns:
                values = predictions.columns[symbol]
                if isinstance(values, MapColumn):
                    continue  # a map is no plain value: the record path decides these rows
                columns[symbol] = column(values[index] if isinstance(values, np.ndarray) else [values[i] for i in todo],
                                         len(todo))
            elif self._online_reads(rules) is None:
                continue  # the rules read no online feature: null
            elif isinstance(online, OnlineRows) and symbol in online.layout.double_fields:
                values, valid = online.doubles(symbol, entities)
                columns[symbol] = Column(float, values, valid & ~np.isnan(values))
            else:
                if features is None:
                    features = [online.get(e, {}) for e in entities]
                columns[symbol] = column([f.get(symbol) for f in features], len(todo))
        return columns

    def _online_reads(self, rules: tuple[CompiledRule, ...]) -> FeastLayout | None:
        """The online fields ``rules`` read (None: none; see :meth:`OnlineReads.narrowed`)."""
        return self.online.narrowed(rules) if self.online is not None else None

    def _rule_held_back(self, rule: CompiledRule, entity: str, end: int) -> bool:
        """Whether a firing of ``rule`` on ``entity`` at ``end`` is held back (a repeat, or in its cooldown)."""
        spec = rule.spec
        cooldown = self.settings.cooldown_ms if spec.cooldown_s is None else int(spec.cooldown_s * 1000)
        return self._held_back(spec.name, spec.action, entity, end, cooldown)

    def _held_back(self, name: str, action: str, entity: str, end: int, cooldown_ms: int) -> bool:
        why = self.memory.held_back(name, action, entity, end, cooldown_ms)
        if why is not None:
            _child(SUPPRESSED, self.name, name, why).inc()
        return why is not None

    def _fire(self, rule: CompiledRule, record: Record, value: dict, context: dict, level: Level,
              missing: tuple[str, ...]) -> Output:
        """The action of ``rule`` firing on ``value`` (not held back: see :meth:`_rule_held_back`)."""
        _child(FIRED, self.name, rule.spec.name, level).inc()
        return self.actions.fired(rule, rule.topic, record, value, context, level, missing, self.book.source)

    def _safe_default(self, record: Record, window: dict) -> Output | None:
        safe = self.settings.degradation.safe_default
        assert safe is not None and self.safe_topic is not None
        if self._held_back("safe_default", safe.action, window[self.entity], window[self.time],
                           self.settings.cooldown_ms):
            return None
        _child(FIRED, self.name, "safe_default", "L3").inc()
        return self.actions.action("safe_default", safe.action, self.safe_topic, record, window, safe.reason, {}, "L3",
                                   (), "degradation.safe_default")


class _Inputs:
    """The records of one kind (predictions, or feature windows) of a micro-batch: each one's entity and time,
    its value decoded only when something needs it, and ``columns`` — the fields the rules read — when the
    records were decoded as one batch (``None``: each was decoded on its own)."""

    def __init__(self, processor: RuleProcessor, records: list[Record], values: list[dict | None],
                 columns: dict[str, Any] | None):
        self.records, self.columns = records, columns
        self._values, self._codecs = values, processor.input_codecs
        self._lists: tuple[frozenset[str], dict[str, list]] | None = None  # :meth:`fields`'s columns, as lists
        entity, time = processor.entity, processor.time
        if columns is not None:
            self.entities: list[str] = list(columns[entity])
            self.times: list[int] = np.asarray(columns[time]).tolist()
            ms = columns.get("inference_ms")
            self.inference_ms: list[float] = ms.tolist() if isinstance(ms, np.ndarray) else [0.0] * len(records)
        else:
            self.entities = [v[entity] for v in values]
            self.times = [v[time] for v in values]
            self.inference_ms = [v.get("inference_ms", 0.0) for v in values]

    def fields(self, i: int, names: frozenset[str]) -> dict:
        """Record ``i``'s fields ``names`` (those of its schema), from the batch's columns when they hold them all as
        plain values, else its whole value (:meth:`value`)."""
        if self._lists is None or self._lists[0] != names:
            columns = self.columns
            usable = columns is not None and all(n in columns and not isinstance(columns[n], MapColumn) for n in names)
            self._lists = names, ({n: (c.tolist() if isinstance(c, np.ndarray) else c)
                                   for n in names for c in (columns[n],)} if usable else {})
        lists = self._lists[1]
        if not lists:
            return self.value(i)
        return {n: column[i] for n, column in lists.items()}

    def value(self, i: int) -> dict:
        """Record ``i``'s value (decoded by its codec the first time: the batch codec already proved it decodes)."""
        value = self._values[i]
        if value is None:
            record = self.records[i]
            value = self._values[i] = self._codecs[record.topic].decode(record.value)
        return value


@lru_cache(maxsize=4096)
def _child(metric: Counter, *labels: str) -> Any:
    """A counter's child for ``labels``, looked up once (``labels()`` costs microseconds on the hot path)."""
    return metric.labels(*labels)


def _has_field(codec: AvroCodec, name: str) -> bool:
    return any(f.get("name") == name for f in codec.schema_json.get("fields", []))


__all__ = ["RuleProcessor", "RuleSpec"]
