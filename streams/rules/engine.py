"""Compiled rules: safe expressions (rule-engine, never ``eval``), priorities, deterministic action ids.

A :class:`RuleBook` is one immutable, compiled version of a rule set. The processor swaps the
whole book between micro-batches when the config center publishes a new one, so every record
of a batch is decided by exactly one version.

rule-engine parses and checks each rule; evaluating its syntax tree node by node costs tens of
microseconds a rule (the profile of the rule processor: a third of its time in
``rule_engine.engine.Rule.evaluate``). So the tree is also turned into a chain of Python closures
(:func:`closure`) for what rules are made of — ``and``, ``or``, ``not``, ``==``, ``!=``, ``<``,
``<=``, ``>``, ``>=``, symbols and literals — with rule-engine's own semantics: values of different
types are never equal, ordering them is an error, ``null`` orders only against ``null``, numbers
compare as rule-engine's decimals do. A rule with any other construct, and a record whose value is
not a plain number, string, boolean or null, is evaluated by rule-engine itself; an ordering
comparison of NaN is an evaluation error (rule-engine's decimals would raise ``InvalidOperation``).
``tests/unit/test_rule_closures.py`` checks the two agree on generated rules and records.
"""

from __future__ import annotations

import decimal
import hashlib
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import rule_engine
from rule_engine import ast as rast

from streams.errors import TopologyError
from streams.rules.spec import Level, RuleSpec
from streams.rules.vector import Column, NotVectorised, Vector, vectorise

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_KEYWORDS = {"and", "or", "not", "true", "false", "null", "in", "if", "else", "for"}


Closure = Callable[[dict], Any]


class _Uncovered(Exception):
    """What the closures do not cover: rule-engine evaluates it."""


#: rule-engine's type of a plain value: ints and floats are both its FLOAT (a decimal).
_KIND: dict[type, type] = {bool: bool, int: float, float: float, str: str, type(None): type(None)}
#: Beyond this, an int and a float compare differently as Python numbers and as rule-engine's decimals.
_EXACT = 2 ** 53
_ORDERED = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


def _symbol(name: str) -> Closure:
    def value(ctx: dict) -> Any:
        v = ctx.get(name)
        if type(v) not in _KIND:
            raise _Uncovered(name)
        return v
    return value


def _literal(node: rast.ExpressionBase) -> Closure:
    value = node.value
    if isinstance(value, decimal.Decimal):
        as_float = float(value)
        if decimal.Decimal(repr(as_float)) != value:  # a literal no float spells: rule-engine compares it
            raise _Uncovered(str(value))
        value = as_float
    return lambda ctx: value


def _mixed_beyond_exact(a: Any, b: Any) -> bool:
    return type(a) is not type(b) and (type(a) is int and abs(a) >= _EXACT or type(b) is int and abs(b) >= _EXACT)


def _equal(left: Closure, right: Closure, negate: bool) -> Closure:
    def eq(ctx: dict) -> bool:
        a, b = left(ctx), right(ctx)
        if _KIND[type(a)] is not _KIND[type(b)]:
            return negate
        if _mixed_beyond_exact(a, b):
            raise _Uncovered("a large int beside a float")
        return (a != b) if negate else (a == b)
    return eq


def _ordered(op: Callable[[Any, Any], bool], left: Closure, right: Closure) -> Closure:
    both_null = op in (operator.ge, operator.le)

    def compare(ctx: dict) -> bool:
        a, b = left(ctx), right(ctx)
        if a is None and b is None:
            return both_null
        kind = _KIND[type(a)]
        if kind is not _KIND[type(b)] or a is None:
            raise rule_engine.EvaluationError("data type mismatch")
        if kind is float:
            if a != a or b != b:
                raise rule_engine.EvaluationError("NaN cannot be ordered")
            if _mixed_beyond_exact(a, b):
                raise _Uncovered("a large int beside a float")
        return op(a, b)
    return compare


def closure(node: rast.ExpressionBase) -> Closure:
    """``node`` of a parsed rule as a Python closure over a record's context; ``_Uncovered`` when it has a
    construct the closures do not cover."""
    kind = type(node)
    if kind is rast.SymbolExpression and node.scope is None:
        return _symbol(node.name)
    if kind in (rast.FloatExpression, rast.StringExpression, rast.BooleanExpression, rast.NullExpression):
        return _literal(node)
    if kind is rast.LogicExpression:
        left, right = closure(node.left), closure(node.right)
        if node.type == "and":
            return lambda ctx: bool(left(ctx) and right(ctx))
        return lambda ctx: bool(left(ctx) or right(ctx))
    if kind is rast.UnaryExpression and node.type == "not":
        inner = closure(node.right)
        return lambda ctx: not inner(ctx)
    if kind is rast.ComparisonExpression and node.type in ("eq", "ne"):
        return _equal(closure(node.left), closure(node.right), negate=node.type == "ne")
    if kind is rast.ArithmeticComparisonExpression and node.type in _ORDERED:
        return _ordered(_ORDERED[node.type], closure(node.left), closure(node.right))
    raise _Uncovered(kind.__name__)


class CompiledRule:
    """A parsed rule; raises TopologyError naming the rule, the position of a syntax error and the reason."""

    _context = rule_engine.Context(default_value=None)

    def __init__(self, spec: RuleSpec, position: int | None = None):
        self.spec = spec
        self.topic: str = spec.topic or ""  # resolved by RuleBook.build
        where_rule = f"rule {spec.name!r}" + (f" (#{position + 1} of its rule set)" if position is not None else "")
        try:
            self.rule = rule_engine.Rule(spec.when, context=self._context)
        except rule_engine.RuleSyntaxError as exc:
            token = getattr(exc, "token", None)
            where = f" at position {token.lexpos}" if token is not None else f" at position {len(spec.when)} (end)"
            raise TopologyError(f"{where_rule}: syntax error{where} in {spec.when!r}: {exc.message}") from None
        except rule_engine.EngineError as exc:
            raise TopologyError(f"{where_rule}: {exc.message} in {spec.when!r}") from None
        code = _STRING.sub("", spec.when)
        self.symbols = tuple(dict.fromkeys(s for s in _IDENT.findall(code) if s not in _KEYWORDS))
        try:
            self._closure: Closure | None = closure(self.rule.statement.expression)
        except _Uncovered:
            self._closure = None  # rule-engine evaluates it, every time
        try:
            self._vector: Vector | None = vectorise(self.rule.statement.expression)
        except NotVectorised:
            self._vector = None  # record by record only

    @property
    def compiled(self) -> bool:
        """Whether the rule runs as closures (else rule-engine evaluates its tree)."""
        return self._closure is not None

    @property
    def vectorised(self) -> bool:
        """Whether :meth:`matches_batch` can evaluate the rule over columns."""
        return self._vector is not None

    def matches_batch(self, columns: Mapping[str, Column], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Over a batch's columns (every symbol the rule reads; see :mod:`streams.rules.vector`): per row, whether
        the rule holds and whether that is known here (a row not known is for :meth:`matches` to decide)."""
        assert self._vector is not None, f"rule {self.spec.name!r} is not vectorised"
        result = self._vector(columns, rows)
        return result.truth() & result.valid, result.valid

    def matches(self, context: dict) -> bool:
        """Whether the rule holds for ``context``; ``rule_engine.EngineError`` when it cannot be evaluated."""
        if self._closure is not None:
            try:
                return bool(self._closure(context))
            except _Uncovered:
                pass  # a value the closures do not cover: rule-engine decides this record
        return bool(self.rule.matches(context))


def compile_rules(specs: Iterable[RuleSpec]) -> list[CompiledRule]:
    """Compile every rule; the first error names the rule, its place in the set, the position and the reason."""
    return [CompiledRule(spec, i) for i, spec in enumerate(specs)]


def action_id(rule: str, entity: str, time: int) -> str:
    """Deterministic id of an action: the same rule on the same entity and time gives the same id."""
    return hashlib.sha256(f"{rule}|{entity}|{time}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RuleBook:
    """One compiled version of a rule set, ordered by priority (highest first, then declaration order)."""

    rules: tuple[CompiledRule, ...]
    source: str  # "topology" or "config v<N>"
    version: int  # 0 for the topology's rules, else the config center's version

    @classmethod
    def build(cls, specs: Iterable[RuleSpec], source: str, version: int, topics: dict[str, str]) -> RuleBook:
        """Compile ``specs``; ``topics`` maps action types (and output topics) to topics (rules may name one)."""
        compiled = compile_rules(specs)
        for rule in compiled:
            topic = rule.spec.topic or topics.get(rule.spec.action)
            if topic is None or topic not in topics.values():
                raise TopologyError(f"rule {rule.spec.name!r} emits {rule.spec.action!r} to "
                                    f"{rule.spec.topic or '(no topic)'}, which is not an output of the processor "
                                    f"(outputs: {', '.join(sorted(set(topics.values())))})")
            rule.topic = topic
        ordered = sorted((r for r in compiled if r.spec.enabled), key=lambda r: -r.spec.priority)
        return cls(tuple(ordered), source, version)

    @property
    def label(self) -> str:
        return self.source

    def at(self, level: Level) -> tuple[CompiledRule, ...]:
        """The rules that run at ``level``."""
        return tuple(r for r in self.rules if level in r.spec.levels)
