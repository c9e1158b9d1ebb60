"""Rules over columns decide every row they call known exactly as the record path does (streams.rules.vector).

Generated rules (those of ``test_rule_closures``) are evaluated on generated batches both ways: each row
the vector path calls known has the record path's answer, and the record path raises no error there;
the rows it leaves unknown are those the record path must decide (nulls, NaN, mixed types, errors).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.rules.engine import CompiledRule
from streams.rules.spec import RuleSpec
from streams.rules.vector import column
from test_rule_closures import REFERENCE_RULES, SYMBOLS, VALUES, expressions, outcome, parsed


def _check(rule: CompiledRule, rows: list[dict], columns: dict) -> int:
    holds, known = rule.matches_batch(columns, len(rows))
    for i, context in enumerate(rows):
        if known[i]:
            assert outcome(rule.matches, context) == bool(holds[i]), (rule.spec.when, context)
    return int(known.sum())


@settings(max_examples=400, deadline=None)
@given(expressions(), st.lists(st.fixed_dictionaries({s: VALUES for s in SYMBOLS}), min_size=1, max_size=8))
def test_rows_called_known_are_decided_as_the_record_path_decides(when, rows):
    rule = parsed(when)
    if rule is None or not rule.vectorised:
        return
    _check(rule, rows, {s: column([r[s] for r in rows], len(rows)) for s in SYMBOLS})


@settings(max_examples=200, deadline=None)
@given(expressions(), st.integers(min_value=1, max_value=8), st.randoms(use_true_random=False))
def test_numpy_columns_as_the_batch_codec_decodes_them(when, n, rng):
    rule = parsed(when)
    if rule is None or not rule.vectorised:
        return
    arrays = {"a": np.array([rng.choice([0.0, 0.8, -2.5, float("nan"), 3.0, 1e23]) for _ in range(n)]),
              "b": np.array([rng.choice([0, 1, -3, 2 ** 53 + 1]) for _ in range(n)], dtype=np.int64),
              "label": [rng.choice(["bearing_wear", "", "x"]) for _ in range(n)],
              "score": np.array([rng.choice([True, False]) for _ in range(n)])}
    rows = [{"a": float(arrays["a"][i]), "b": int(arrays["b"][i]), "label": arrays["label"][i],
             "score": bool(arrays["score"][i])} for i in range(n)]
    _check(rule, rows, {s: column(v, n) for s, v in arrays.items()})


@pytest.mark.parametrize("when", REFERENCE_RULES)
def test_the_reference_apps_rules_are_vectorised(when):
    assert CompiledRule(RuleSpec(name="r", when=when, action="review")).vectorised


def test_plain_values_are_known_and_nulls_nan_and_mismatches_are_not():
    rule = CompiledRule(RuleSpec(name="r", when="label == 'bearing_wear' and confidence >= 0.8", action="review"))
    rows = [{"label": "bearing_wear", "confidence": 0.9}, {"label": "healthy", "confidence": None},
            {"label": "bearing_wear", "confidence": float("nan")}, {"label": "bearing_wear", "confidence": "high"},
            {"label": "bearing_wear", "confidence": 0.5}, {"label": None, "confidence": 0.9}]
    columns = {s: column([r[s] for r in rows], len(rows)) for s in ("label", "confidence")}
    holds, known = rule.matches_batch(columns, len(rows))
    # row 1: the left side decides (not bearing_wear), so the null on the right is never read
    assert known.tolist() == [True, True, False, False, True, False]
    assert holds.tolist() == [True, False, False, False, False, False]
    assert _check(rule, rows, columns) == 3


def test_a_symbol_with_no_column_is_null_in_every_row():
    rule = CompiledRule(RuleSpec(name="r", when="missing_rate > 0.3", action="review"))
    holds, known = rule.matches_batch({}, 4)
    assert not known.any() and not holds.any()


def test_other_constructs_are_not_vectorised():
    for when in ("a + 1 > 2", "label =~ 'bear.*'", "a in [1, 2]", "a == 0.80000000000000001"):
        assert not CompiledRule(RuleSpec(name="r", when=when, action="review")).vectorised
