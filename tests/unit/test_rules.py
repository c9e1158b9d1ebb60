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


# ---- priorities, levels, rule books ------------------------------------------------------------

from reference import REPO as PROJECT_ROOT  # noqa: E402
from streams.config_center.schemas import DEFAULT_SCHEMAS  # noqa: E402
from streams.errors import ConfigValidationError  # noqa: E402
from streams.rules import RuleBook, RuleSetValue  # noqa: E402
from streams.rules.check import rule_problems  # noqa: E402
from streams.topology import load_topology  # noqa: E402

TOPICS = {"maintenance": "pm.actions.maintenance", "review": "pm.actions.review"}


@pytest.mark.parametrize(
    "when, context, expected",
    [
        ("score > 0.9 and vibration_std > 7", {"score": 0.95, "vibration_std": 8.0}, True),
        ("score > 0.9 and vibration_std > 7", {"score": 0.95, "vibration_std": 6.0}, False),
        ("confidence < 0.7", {"confidence": 0.69}, True),
        ("confidence < 0.7", {"confidence": 0.7}, False),
        ("label in ['bearing_wear', 'overheating']", {"label": "overheating"}, True),
        ("label != 'healthy' and score >= 0.5", {"label": "healthy", "score": 0.99}, False),
        ("temperature_mean > 72 or missing_rate >= 0.5", {"temperature_mean": 60.0, "missing_rate": 0.5}, True),
        ("label == null", {}, True),  # a field the record lacks reads as null (L2: no model)
        ("label =~ 'bear.*'", {"label": "bearing_wear"}, True),
    ],
)
def test_rule_semantics_table(when, context, expected):
    assert CompiledRule(RuleSpec(name="r", when=when, **SPEC)).matches(context) is expected


def test_book_orders_by_priority_and_drops_disabled_rules():
    book = RuleBook.build([RuleSpec(name="low", when="true", action="review", priority=1),
                           RuleSpec(name="high", when="true", action="review", priority=5),
                           RuleSpec(name="off", when="true", action="review", priority=9, enabled=False)],
                          "topology", 0, TOPICS)
    assert [r.spec.name for r in book.rules] == ["high", "low"]
    assert all(r.topic == "pm.actions.review" for r in book.rules)


def test_book_filters_rules_by_level():
    book = RuleBook.build([RuleSpec(name="model", when="score > 0.5", action="review"),
                           RuleSpec(name="features", when="missing_rate > 0.3", action="review", levels=["L2"])],
                          "topology", 0, TOPICS)
    assert [r.spec.name for r in book.at("L0")] == ["model"]
    assert [r.spec.name for r in book.at("L2")] == ["features"]
    assert book.at("L3") == ()


def test_a_rule_without_an_output_topic_is_refused():
    with pytest.raises(TopologyError, match="rule 'r' emits 'alert'.*not an output"):
        RuleBook.build([RuleSpec(name="r", when="true", action="alert")], "topology", 0, TOPICS)


def test_no_rule_runs_at_l3():
    with pytest.raises(ValueError, match="safe_default"):
        RuleSpec(name="r", when="true", action="review", levels=["L3"])


def test_config_center_refuses_a_malformed_rule_at_publish_with_name_position_and_reason():
    good = {"rules": [{"name": "ok", "when": "score > 0.9", "action": "maintenance"}]}
    assert DEFAULT_SCHEMAS.validate("business-rule", "pm.rules", good)["rules"][0]["levels"] == ["L0", "L1"]
    bad = {"rules": [good["rules"][0], {"name": "broken", "when": "score > = 0.9", "action": "alert"}]}
    with pytest.raises(ConfigValidationError, match=r"rule 'broken' \(#2 of its rule set\): syntax error at position \d+"):
        DEFAULT_SCHEMAS.validate("business-rule", "pm.rules", bad)
    with pytest.raises(ValueError, match="unique"):
        RuleSetValue(rules=[good["rules"][0], good["rules"][0]])


def test_plan_check_names_the_processor_and_the_rule(tmp_path):
    text = (PROJECT_ROOT / "topologies" / "predictive_maintenance" / "topology.yaml").read_text()
    assert rule_problems(_write(tmp_path, text)) == []
    broken = text.replace("when: \"temperature_mean > 72\"", "when: \"temperature_mean > = 72\"")
    [problem] = rule_problems(_write(tmp_path, broken))
    assert problem.startswith("processor 'rules': rule 'overheating_features' (#5 of its rule set): syntax error at position")


def _write(tmp_path, text):
    from reference import PM
    from streams.namespace import rooted

    path = tmp_path / "t.yaml"
    path.write_text(rooted(text, PM))
    return load_topology(path)


def test_an_action_carries_the_fields_its_schema_shares_with_the_record_it_decided_on():
    """A document's extracted fields travel with its decision (no join for the subscriber); the action's own
    fields (the reason, the rule) are never overwritten by a same-named field of the record."""
    import json

    from streams.delivery import Record
    from streams.rules.processor import RuleProcessor

    class JsonCodec:
        def __init__(self, fields: list[str]):
            self.schema_json = {"fields": [{"name": f} for f in fields]}

        def encode(self, value: dict) -> bytes:
            return json.dumps(value).encode()

        def decode(self, data: bytes) -> dict:
            return json.loads(data)

    prediction = ["event_id", "doc_id", "uploaded_ms", "model_name", "model_version", "label", "score", "fields",
                  "doc_type", "rule"]
    action = ["event_id", "action_type", "doc_id", "rule", "reason", "fields", "doc_type", "uploaded_ms"]
    settings = RulesSettings(rules=[RuleSpec(name="valid", when="score >= 0.8", action="approve")], entity_field="doc_id",
                             time_field="uploaded_ms", actions={"approve": "x.actions.approve"}, live_config=False)
    processor = RuleProcessor(input_codecs={"x.predictions": JsonCodec(prediction)},
                              output_codecs={"x.actions.approve": JsonCodec(action)}, dlq_topic="x.dlq",
                              redis_url="redis://127.0.0.1:1/0", settings=settings, app="x")
    value = {"event_id": "e1", "doc_id": "d1", "uploaded_ms": 5, "model_name": "ocr", "model_version": "1",
             "label": "id_card", "score": 0.9, "fields": {"name": "王芳"}, "doc_type": "id_card", "rule": "not mine"}
    [out] = processor.process([Record("x.predictions", 0, 0, b"d1", json.dumps(value).encode(), {}, 0)])
    decided = json.loads(out.value)
    assert decided["fields"] == {"name": "王芳"} and decided["doc_type"] == "id_card"
    assert decided["rule"] == "valid" and decided["action_type"] == "approve"
    assert decided["event_id"] != "e1"  # its own id (rule, entity, time), not the prediction's


def test_an_action_sets_exactly_its_own_fields_and_reads_only_what_it_writes():
    """``OWN_FIELDS`` is what ``Actions.action`` writes before carrying anything: a same-named field of the record
    is never carried over it, and what the rule processor decodes of a batch for its actions leaves the
    prediction's ``event_id`` out (an action's id is its own)."""
    from reference import load_schema
    from streams.delivery import Record
    from streams.rules.actions import OWN_FIELDS, Actions

    class Codec:
        def __init__(self, subject: str):
            self.schema_json = load_schema(subject)
            self.written: list[dict] = []

        def encode(self, value: dict) -> bytes:
            self.written.append(value)
            return b""

    prediction, alert = Codec("pm.predictions.anomaly-value"), Codec("pm.actions.alert-value")
    actions = Actions("device_id", "window_end", {"pm.predictions.anomaly": prediction}, {"pm.actions.alert": alert})
    assert actions.carried == {"pm.actions.alert": []}  # every field they share is one the action sets itself
    record = Record("pm.predictions.anomaly", 0, 0, b"d1", b"", {}, 0)
    value = {"device_id": "d1", "window_end": 5000, "label": "overheating", "score": 0.9, "model_name": "anomaly",
             "model_version": "1", "trace_id": "t1", "event_id": "e1"}
    actions.action("overheating", "alert", "pm.actions.alert", record, value, "why", {}, "L0", (), "topology")
    [written] = alert.written
    assert set(written) == OWN_FIELDS | {"device_id", "window_end"} and written["event_id"] != "e1"
    fields = frozenset(f["name"] for f in prediction.schema_json["fields"])
    assert actions.reads(fields) == {"device_id", "window_end", "label", "score", "model_name", "model_version",
                                     "trace_id"}
