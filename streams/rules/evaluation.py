"""How the rule processor's records are evaluated by the rules of one level, and what fires.

One micro-batch at a time, with the rule book and the entities' online features the processor read for it
(nothing here reads Redis on its own but a row that was not read first). Two paths give the same actions:

* **columns** (:meth:`Evaluation.evaluate_columns`): predictions decoded as one batch, every vectorised rule
  over every row at once (:mod:`streams.rules.vector`); a row on which some rule cannot be known goes to
* **records** (:meth:`Evaluation.evaluate`): each record's context (its fields over its online features over a
  null for every symbol), each rule in turn.

Of the matching rules of one action type the highest-priority one fires, unless the decision memory holds it
back (a repeat, a cooldown: :mod:`streams.rules.memory`). A rule that cannot be evaluated on a record sends the
record to the DLQ (``rule_unevaluable``, ``rule_missing_input`` when an input has no value); its other rules
still decide. At L3, a feature window yields the declared safe default (:meth:`Evaluation.safe_default`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import rule_engine
from prometheus_client import Counter

from streams.avro import AvroCodec
from streams.columnar import MapColumn
from streams.delivery import Output, Record, dead_letter
from streams.features.layout import FeastLayout
from streams.features.online import OnlineRows
from streams.rules.actions import Actions
from streams.rules.engine import CompiledRule, RuleBook
from streams.rules.memory import DecisionMemory
from streams.rules.online_reads import OnlineReads
from streams.rules.spec import Level, RulesSettings
from streams.rules.vector import Column, column

log = logging.getLogger("tangram.rules")

FIRED = Counter("tangram_rules_fired_total", "Actions emitted per rule and level.", ["processor", "rule", "level"])
SUPPRESSED = Counter("tangram_rules_suppressed_total", "Firings held back, by why (cooldown, duplicate, priority).",
                     ["processor", "rule", "why"])
UNEVALUABLE = Counter("tangram_rules_evaluation_errors_total", "Rules that could not be evaluated on a record.",
                      ["processor", "rule"])

#: One record to decide: the record, its value, and the fusion members it was decided without.
Item = tuple[Record, dict, tuple[str, ...]]


class Inputs:
    """The records of one kind (predictions, or feature windows) of a micro-batch: each one's entity and time,
    its value decoded only when something needs it, and ``columns`` — the fields the rules read — when the
    records were decoded as one batch (``None``: each was decoded on its own)."""

    def __init__(self, records: list[Record], values: list[dict | None], columns: dict[str, Any] | None,
                 entity: str, time: str, codecs: Mapping[str, AvroCodec]):
        self.records, self.columns = records, columns
        self._values, self._codecs = values, codecs
        self._lists: tuple[frozenset[str], dict[str, list]] | None = None  # :meth:`fields`'s columns, as lists
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


class Evaluation:
    """The rules of a level over a batch's records → actions (and dead letters), as one processor decides them."""

    def __init__(self, name: str, settings: RulesSettings, actions: Actions, memory: DecisionMemory,
                 online: OnlineReads | None, read_online: Callable[[list[str]], Mapping[str, dict]],
                 prediction_fields: frozenset[str], dlq_topic: str, safe_topic: str | None):
        self.name, self.settings, self.actions, self.memory = name, settings, actions, memory
        self.entity, self.time = settings.entity_field, settings.time_field
        self.online, self.read_online = online, read_online
        self.prediction_fields, self.dlq_topic, self.safe_topic = prediction_fields, dlq_topic, safe_topic
        self.action_reads = actions.reads(prediction_fields)  # a batch decoded as columns holds them

    def evaluate(self, book: RuleBook, level: Level, items: list[Item], online: Mapping[str, dict],
                 with_online: bool) -> list[Output]:
        """Each of ``items`` by the rules of ``level``, record by record (``online``: the entities' rows, read for
        the batch before anything changed; ``with_online``: whether the rules see them)."""
        if not items:
            return []
        rules = book.at(level)
        rows: list[dict] = [{}] * len(items)
        if with_online and self._online_reads(rules) is not None:
            unread = list(dict.fromkeys(v[self.entity] for _, v, _ in items if v[self.entity] not in online))
            if unread:  # not expected: every entity decided here was read first
                online = {**online, **self.read_online(unread)}
            rows = [online.get(v[self.entity], {}) for _, v, _ in items]
        outputs = []
        blank = _blank(rules)
        for (record, value, missing), features in zip(items, rows):
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
                    outputs.append(self._fire(book, rule, record, value, context, level, missing))
            if failed:
                log.warning("%s: %s: %d rule(s) could not be evaluated, to the DLQ: %s", self.name, record.where,
                            len(failed), "; ".join(failed))
                reason = "rule_missing_input" if missing_input else "rule_unevaluable"
                outputs.append(dead_letter(record, self.dlq_topic, self.name, "; ".join(failed), reason))
        return outputs

    def evaluate_columns(self, book: RuleBook, level: Level, predictions: Inputs, todo: list[int],
                         online: Mapping[str, dict]) -> list[Output]:
        """:meth:`evaluate` for the rows ``todo`` of a batch decoded as columns: every rule over every row at once
        (:mod:`streams.rules.vector`); a row on which no rule holds is done, a row on which some rule is not
        known goes to :meth:`evaluate`, and the firings of the others are held back or emitted as there."""
        rules = book.at(level)
        if not todo or not rules:
            return []
        n = len(todo)
        columns = self._rule_columns(predictions, todo, rules, online)
        verdicts = [rule.matches_batch(columns, n) for rule in rules]
        holds = np.stack([h for h, _ in verdicts])  # rules x rows
        decided = np.stack([k for _, k in verdicts]).all(axis=0)
        reads = self._online_reads(rules) is not None
        # what a firing reads of its prediction: the action's fields and the rules' symbols the prediction carries
        fields = self.action_reads.union(*(r.symbols for r in rules)) & self.prediction_fields
        blank = _blank(rules)
        outputs: list[Output] = []
        for j in np.flatnonzero(holds.any(axis=0) | ~decided).tolist():
            i = todo[j]
            record = predictions.records[i]
            if not decided[j]:
                outputs += self.evaluate(book, level, [(record, predictions.value(i), ())], online, with_online=True)
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
                    context = {**blank, **(online.get(entity, {}) if reads else {}), **value}
                    outputs.append(self._fire(book, rule, record, value, context, level, ()))
        return outputs

    def safe_default(self, record: Record, window: dict) -> Output | None:
        """The declared safe default's action on ``window`` (L3), unless held back like any firing."""
        safe = self.settings.degradation.safe_default
        assert safe is not None and self.safe_topic is not None
        if self._held_back("safe_default", safe.action, window[self.entity], window[self.time],
                           self.settings.cooldown_ms):
            return None
        _child(FIRED, self.name, "safe_default", "L3").inc()
        return self.actions.action("safe_default", safe.action, self.safe_topic, record, window, safe.reason, {}, "L3",
                                   (), "degradation.safe_default")

    def _rule_columns(self, predictions: Inputs, todo: list[int], rules: tuple[CompiledRule, ...],
                      online: Mapping[str, dict]) -> dict[str, Column]:
        """The column of every symbol ``rules`` read, over the rows ``todo``: the prediction's field, else the
        entity's online feature (when the rules read the online store), else none (null)."""
        index = np.asarray(todo, dtype=np.int64)
        entities = [predictions.entities[i] for i in todo]
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

    def _fire(self, book: RuleBook, rule: CompiledRule, record: Record, value: dict, context: dict, level: Level,
              missing: tuple[str, ...]) -> Output:
        """The action of ``rule`` firing on ``value`` (not held back: see :meth:`_rule_held_back`)."""
        _child(FIRED, self.name, rule.spec.name, level).inc()
        return self.actions.fired(rule, rule.topic, record, value, context, level, missing, book.source)


def _blank(rules: tuple[CompiledRule, ...]) -> dict:
    """Null for every symbol ``rules`` read: a record's context starts from it, so every symbol is present
    (rule-engine's slow path for an unknown symbol computes spelling suggestions first)."""
    return dict.fromkeys((s for r in rules for s in r.symbols), None)


@lru_cache(maxsize=4096)
def _child(metric: Counter, *labels: str) -> Any:
    """A counter's child for ``labels``, looked up once (``labels()`` costs microseconds on the hot path)."""
    return metric.labels(*labels)
