"""Rules over a whole batch at once: a rule's tree as numpy operations on columns.

The rule processor decides hundreds of records a batch, and most of them fire nothing. Evaluating
each rule on each record's dict (even as closures, :mod:`streams.rules.engine`) costs a microsecond or
more per rule and record, plus the dict. Here a rule is evaluated on every row of a batch with a few
numpy operations, and the answer for each row is three-valued: it holds, it does not, or it is not
known here. A row is not known when a value it reads is null, NaN, not a plain number, string or
boolean, an int too large to compare exactly beside a float, or when the comparison would be an
evaluation error (ordering values of different types): those rows go to the record-at-a-time path
(``CompiledRule.matches``), which gives rule-engine's answer or its error, so the two paths decide
every row the same way (``tests/unit/test_rule_vectors.py`` checks it on generated rules and records).

Covered: what the closures cover — ``and``, ``or``, ``not``, ``==``, ``!=``, ``<``, ``<=``, ``>``,
``>=``, symbols and literals — with the same semantics (values of different types are never equal,
``and``/``or`` short-circuit on truthiness). A rule with any other construct is not vectorised.
"""

from __future__ import annotations

import decimal
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rule_engine import ast as rast

#: Beyond this an int compares differently as a float (rule-engine compares decimals exactly).
_EXACT = 2 ** 53
_ORDERED = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}
_NONE = type(None)


@dataclass(frozen=True)
class Column:
    """One value per row: ``values[i]`` where ``valid[i]``; ``kind`` is rule-engine's type of every valid
    value (``float`` for numbers, ``str``, ``bool``, or ``NoneType`` for null)."""

    kind: type
    values: np.ndarray
    valid: np.ndarray

    def truth(self) -> np.ndarray:
        """Python's truthiness of each valid value."""
        if self.kind is bool:
            return self.values.astype(bool, copy=False)
        if self.kind is float:
            return self.values != 0
        if self.kind is str:
            return self.values != ""
        return np.zeros(len(self.valid), dtype=bool)


def column(values: Sequence[Any] | np.ndarray, rows: int) -> Column:
    """The column of a batch's values of one symbol: a numpy array (numbers, booleans) or a list."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "biuf":
        if values.dtype.kind == "b":
            return Column(bool, values, np.ones(rows, dtype=bool))
        as_float = values.astype(np.float64)
        valid = np.abs(values) < _EXACT if values.dtype.kind in "iu" else ~np.isnan(as_float)
        return Column(float, as_float, valid)
    values = list(values)
    kinds = {type(v) for v in values}
    if kinds <= {str}:
        return Column(str, np.array(values, dtype=object), np.ones(rows, dtype=bool))
    if kinds <= {bool}:
        return Column(bool, np.array(values, dtype=bool), np.ones(rows, dtype=bool))
    if kinds <= {int, float}:
        valid = np.array([(v == v) if type(v) is float else abs(v) < _EXACT for v in values], dtype=bool)
        return Column(float, np.array([float(v) for v in values], dtype=np.float64), valid)
    # nulls or mixed types: each row of the one kind its valid values share; the rest to the record path
    main = next((k for k in (float, str, bool) if any(_kind(v) is k for v in values)), _NONE)
    valid = np.array([_kind(v) is main and (type(v) is not float or v == v)
                      and (type(v) is not int or abs(v) < _EXACT) for v in values], dtype=bool)
    if main is float:
        data = np.array([float(v) if ok else 0.0 for v, ok in zip(values, valid)], dtype=np.float64)
    elif main is bool:
        data = np.array([bool(v) if ok else False for v, ok in zip(values, valid)], dtype=bool)
    else:
        data = np.array([v if ok else "" for v, ok in zip(values, valid)], dtype=object)
    return Column(main, data, valid & (main is not _NONE))


def _kind(value: Any) -> type | None:
    kind = type(value)
    if kind is int:
        return float
    return kind if kind in (float, str, bool) else None


def _constant(value: Any, rows: int) -> Column:
    kind = _NONE if value is None else (float if type(value) in (int, float) else type(value))
    dtype = {float: np.float64, bool: bool}.get(kind, object)
    return Column(kind, np.full(rows, value if value is not None else 0, dtype=dtype), np.ones(rows, dtype=bool))


Vector = Callable[[Mapping[str, Column], int], Column]


class NotVectorised(Exception):
    """A construct the vector path does not cover: the rule is evaluated record by record."""


def vectorise(node: rast.ExpressionBase) -> Vector:
    """``node`` of a parsed rule as a function of a batch's columns (every symbol it reads; a symbol with no
    column is null in every row); ``NotVectorised`` when it has a construct this module does not cover."""
    kind = type(node)
    if kind is rast.SymbolExpression and node.scope is None:
        name = node.name
        return lambda columns, rows: columns.get(name) or Column(_NONE, np.zeros(rows), np.zeros(rows, dtype=bool))
    if kind in (rast.FloatExpression, rast.StringExpression, rast.BooleanExpression, rast.NullExpression):
        value = node.value
        if isinstance(value, decimal.Decimal):
            if decimal.Decimal(repr(float(value))) != value:  # no float spells it: the record path compares it
                raise NotVectorised(str(value))
            value = float(value)
        return lambda columns, rows: _constant(value, rows)
    if kind is rast.LogicExpression:
        left, right, both = vectorise(node.left), vectorise(node.right), node.type == "and"
        return lambda columns, rows: _logic(left(columns, rows), right(columns, rows), both)
    if kind is rast.UnaryExpression and node.type == "not":
        inner = vectorise(node.right)

        def negate(columns: Mapping[str, Column], rows: int) -> Column:
            x = inner(columns, rows)
            return Column(bool, ~x.truth(), x.valid)
        return negate
    if kind is rast.ComparisonExpression and node.type in ("eq", "ne"):
        left, right, ne = vectorise(node.left), vectorise(node.right), node.type == "ne"
        return lambda columns, rows: _equal(left(columns, rows), right(columns, rows), ne)
    if kind is rast.ArithmeticComparisonExpression and node.type in _ORDERED:
        left, right, op = vectorise(node.left), vectorise(node.right), _ORDERED[node.type]
        return lambda columns, rows: _ordered(left(columns, rows), right(columns, rows), op)
    raise NotVectorised(kind.__name__)


def _logic(a: Column, b: Column, both: bool) -> Column:
    """``a and b`` / ``a or b`` as Python evaluates them: the right side is read only when the left does not
    decide, so a row whose left side decides is known whatever its right side."""
    ta, tb = a.truth(), b.truth()
    if both:
        return Column(bool, ta & tb, a.valid & (~ta | b.valid))
    return Column(bool, ta | tb, a.valid & (ta | b.valid))


def _equal(a: Column, b: Column, ne: bool) -> Column:
    valid = a.valid & b.valid
    if a.kind is not b.kind:  # values of different types are never equal
        return Column(bool, np.full(len(valid), ne), valid)
    if a.kind is _NONE:
        return Column(bool, np.full(len(valid), not ne), valid)
    same = np.asarray(a.values == b.values, dtype=bool)
    return Column(bool, ~same if ne else same, valid)


def _ordered(a: Column, b: Column, op: Callable[[Any, Any], Any]) -> Column:
    valid = a.valid & b.valid
    if a.kind is not b.kind:  # ordering values of different types is an error: the record path raises it
        return Column(bool, np.zeros(len(valid), dtype=bool), np.zeros(len(valid), dtype=bool))
    if a.kind is _NONE:  # null orders only against null: equal
        return Column(bool, np.full(len(valid), op in (operator.ge, operator.le)), valid)
    return Column(bool, np.asarray(op(a.values, b.values), dtype=bool), valid)


__all__ = ["Column", "NotVectorised", "Vector", "column", "vectorise"]
