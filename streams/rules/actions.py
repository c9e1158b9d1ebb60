"""The action records the rule processor emits: what a firing says, and what it carries of what it decided on.

An action names the rule, its inputs (the values the condition read), the reason (the condition with those
values), the model and its version, the rule-set version and the degradation level in effect, with a
deterministic ``event_id`` (:func:`streams.rules.engine.action_id`). It also carries every other field its
schema shares with the record it decided on (a document's extracted fields, say), so a subscriber sees what
was decided on without a join; the action's own fields are never overwritten by a same-named field of the
record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streams.delivery import H_EVENT_ID, H_TRACE_ID, Output, Record, carry_headers
from streams.rules.engine import CompiledRule, action_id
from streams.rules.spec import FusionSpec, Level
from streams.wire import Codec

#: The fields an action sets itself (besides the entity and time fields): never carried from the record.
OWN_FIELDS = frozenset({"event_id", "action_type", "rule", "reason", "inputs", "label", "score", "model_name",
                        "model_version", "model_versions", "missing_models", "rule_set", "degradation_level",
                        "trace_id"})
#: What an action reads of the prediction it fires on, besides the fields it carries.
_READS = ("label", "score", "model_name", "model_version", "model_versions", "trace_id")


class Actions:
    """Builds the action of a firing for one rule processor's output topics."""

    def __init__(self, entity: str, time: str, input_codecs: Mapping[str, Codec], output_codecs: Mapping[str, Codec],
                 fusion: FusionSpec | None = None):
        self.entity, self.time = entity, time
        self.output_codecs, self.fusion = output_codecs, fusion
        inputs = {f.get("name") for c in input_codecs.values() for f in c.schema_json.get("fields", [])}
        own = OWN_FIELDS | {entity, time}
        # per action topic: the fields its schema shares with the inputs' schemas that it does not set itself
        self.carried = {t: [n for f in c.schema_json.get("fields", []) if (n := f.get("name")) in inputs and n not in own]
                        for t, c in output_codecs.items()}

    def reads(self, fields: frozenset[str]) -> frozenset[str]:
        """What an action reads of a record with ``fields`` (a batch decoded as columns holds them, so a firing
        needs no decode of its record of its own)."""
        return frozenset({self.entity, self.time, *_READS, *(n for names in self.carried.values() for n in names)}) & fields

    def fired(self, rule: CompiledRule, topic: str, record: Record, value: dict, context: dict, level: Level,
              missing: tuple[str, ...], rule_set: str) -> Output:
        """The action of ``rule`` firing on ``value`` (``context``: every value its condition read)."""
        spec = rule.spec
        inputs = {s: float(context[s]) for s in rule.symbols
                  if isinstance(context.get(s), (int, float)) and not isinstance(context.get(s), bool)}
        shown = ", ".join(f"{s}={context[s]:.4g}" if isinstance(context[s], float) else f"{s}={context[s]!r}"
                          for s in rule.symbols if s in context)
        reason = f"{spec.when} with {shown}"
        if "model_versions" in value and len(value["model_versions"]) > 1 or missing:
            method = self.fusion.method if self.fusion else ""
            reason += f" (fused {method} of {value['model_name']}" + (
                f"; missing {', '.join(missing)} after {self.fusion.wait_ms} ms)" if missing and self.fusion else ")")
        if level == "L2":
            reason += " (degradation L2: features only, no model)"
        return self.action(spec.name, spec.action, topic, record, value, reason, inputs, level, missing, rule_set)

    def action(self, rule: str, action_type: str, topic: str, record: Record, value: dict, reason: str,
               inputs: dict[str, float], level: Level, missing: tuple[str, ...], rule_set: str) -> Output:
        """The action record of ``rule`` deciding on ``value`` (of ``record``) to ``topic``."""
        entity, end = value[self.entity], value[self.time]
        has_model = "model_name" in value
        action: dict[str, Any] = {
            "event_id": action_id(rule, entity, end),
            "action_type": action_type,
            self.entity: entity,
            "rule": rule,
            "reason": reason,
            "inputs": inputs,
            "label": value.get("label", "") if has_model else "",
            "score": float(value.get("score", 0.0)) if has_model else 0.0,
            "model_name": value.get("model_name", ""),
            "model_version": value.get("model_version", ""),
            "model_versions": value.get("model_versions") or (
                {value["model_name"]: value["model_version"]} if has_model else {}),
            "missing_models": list(missing),
            "rule_set": rule_set,
            self.time: end,
            "degradation_level": level,
            "trace_id": value.get("trace_id") or record.header(H_TRACE_ID),
        }
        for name in self.carried[topic]:
            if name in value:
                action[name] = value[name]
        headers = carry_headers(record, **{H_EVENT_ID: action["event_id"]})
        return Output(topic, entity, self.output_codecs[topic].encode(action), headers)


__all__ = ["OWN_FIELDS", "Actions"]
