import pytest
import rule_engine

from streams.errors import TopologyError
from streams.rules import CompiledRule, RuleSpec, RulesSettings, action_id

SPEC = dict(action="maintenance", topic="pm.actions.maintenance")


@pytest.mark.parametrize(
    "when, context, expected",
    [
        ("label == 'bearing_wear' and confidence >= 0.8", {"label": "bearing_wear", "confidence": 0.93}, True),
        ("label == 'bearing_wear' and confidence >= 0.8", {"label": "bearing_wear", "confidence": 0.5}, False),
        ("label == 'bearing_wear' and confidence >= 0.8", {"label": "healthy", "confidence": 0.99}, False),
        ("missing_rate > 0.3", {"missing_rate": 0.5}, True),
        ("score > 0.9 or vibration_std > 7", {"score": 0.1, "vibration_std": 8.0}, True),
        ("not (score > 0.5)", {"score": 0.2}, True),
    ],
)
def test_rule_semantics(when, context, expected):
    assert CompiledRule(RuleSpec(name="r", when=when, **SPEC)).matches(context) is expected


def test_rule_symbols_are_the_inputs_it_reads():
    rule = CompiledRule(RuleSpec(name="r", when="label == 'x' and confidence >= 0.8 and not false", **SPEC))
    assert rule.symbols == ("label", "confidence")


def test_malformed_rule_is_refused_with_name_and_position():
    with pytest.raises(TopologyError, match=r"rule 'broken': syntax error at position \d+"):
        CompiledRule(RuleSpec(name="broken", when="label == = 3", **SPEC))


def test_no_python_is_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    rule = CompiledRule(RuleSpec(name="evil", when=f"__import__('os').system('touch {marker}')", **SPEC))
    with pytest.raises(rule_engine.EngineError):
        rule.matches({})
    assert not marker.exists()


def test_duplicate_rule_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        RulesSettings(rules=[RuleSpec(name="a", when="true", **SPEC), RuleSpec(name="a", when="true", **SPEC)])


def test_action_ids_are_deterministic():
    assert action_id("r", "dev-1", 5000) == action_id("r", "dev-1", 5000)
    assert action_id("r", "dev-1", 5000) != action_id("r", "dev-1", 10000)
