"""The rules' closures decide exactly what rule-engine decides (streams.rules.engine).

Generated rules (and, or, not, the six comparisons, symbols and literals of every plain type) are
evaluated on generated records both ways: the same answer, or an evaluation error both ways. A
rule-engine ``InvalidOperation`` (ordering NaN) counts as an error: the closures raise
``EvaluationError`` there, which the rule processor handles as it handles any rule it cannot evaluate.
"""

from __future__ import annotations

import decimal

import pytest
import rule_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.rules.engine import CompiledRule
from streams.rules.spec import RuleSpec

SYMBOLS = ("a", "b", "label", "score")
#: Literals as a rule spells them: numbers with and without a float twin, strings, booleans, null.
LITERALS = ("0", "1", "0.8", "-2.5", "1e23", "0.80000000000000001", "3.0", "'bearing_wear'", "''", "true", "false",
            "null")
VALUES = st.one_of(
    st.none(), st.booleans(), st.sampled_from(["bearing_wear", "", "x"]),
    st.integers(min_value=-3, max_value=3), st.sampled_from([2 ** 53, 2 ** 53 + 1, 10 ** 23, 99999999999999991611392]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.8, 0.80000000000000004, 1e23, -2.5, 3.0]),
    st.lists(st.integers(), max_size=2),  # a value the closures hand to rule-engine
)


def expressions() -> st.SearchStrategy[str]:
    leaf = st.one_of(st.sampled_from(SYMBOLS), st.sampled_from(LITERALS))
    comparison = st.tuples(leaf, st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), leaf).map(" ".join)
    return st.recursive(
        st.one_of(comparison, leaf),
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(["and", "or"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            inner.map(lambda e: f"not {e}"),
        ),
        max_leaves=6,
    )


def outcome(evaluate, context: dict) -> object:
    try:
        return bool(evaluate(context))
    except (rule_engine.EngineError, decimal.InvalidOperation):
        return "error"


def parsed(when: str) -> CompiledRule | None:
    try:
        return CompiledRule(RuleSpec(name="r", when=when, action="review"))
    except Exception:  # a rule rule-engine refuses to parse (e.g. ordering a literal string against a number)
        return None


@settings(max_examples=600, deadline=None)
@given(expressions(), st.fixed_dictionaries({s: VALUES for s in SYMBOLS}))
def test_the_closures_decide_what_rule_engine_decides(when, context):
    rule = parsed(when)
    if rule is None:
        return
    assert outcome(rule.matches, context) == outcome(rule.rule.matches, context), (when, context)


#: Rules of the shape the reference apps declare.
REFERENCE_RULES = [
    "label == 'bearing_wear' and confidence >= 0.8",
    "missing_rate > 0.3",
    "vibration_std > 1.2 and vibration_mean > 3.5",
    "not complete or (code_valid and min_confidence < 0.8) or (not code_valid and code_confidence < 0.9)",
    "gallery_distance <= 12",
]


@pytest.mark.parametrize("when", REFERENCE_RULES)
def test_the_reference_apps_rules_run_as_closures(when):
    assert CompiledRule(RuleSpec(name="r", when=when, action="review")).compiled


@pytest.mark.parametrize("when", ["a + 1 > 2", "label =~ 'bear.*'", "tags[0] == 'x'", "a in [1, 2]", "-a > 1",
                                  "a == 0.80000000000000001"])
def test_other_constructs_are_left_to_rule_engine_and_still_decided(when):
    rule = CompiledRule(RuleSpec(name="r", when=when, action="review"))
    assert not rule.compiled
    context = {"a": 0.8, "label": "bearing", "tags": ("x",)}
    assert outcome(rule.matches, context) == outcome(rule.rule.matches, context)


def test_a_value_the_closures_do_not_cover_is_decided_by_rule_engine():
    rule = CompiledRule(RuleSpec(name="r", when="a == b", action="review"))
    assert rule.compiled
    assert rule.matches({"a": [1, 2], "b": [1, 2]}) is True  # lists: rule-engine compares its tuples
    assert rule.matches({"a": 2 ** 53 + 1, "b": float(2 ** 53)}) is False


def test_ordering_nan_or_mismatched_types_is_an_evaluation_error():
    rule = CompiledRule(RuleSpec(name="r", when="a > 0.3", action="review"))
    for context in ({"a": float("nan")}, {"a": "high"}, {"a": None}, {"a": True}):
        with pytest.raises(rule_engine.EvaluationError):
            rule.matches(context)
