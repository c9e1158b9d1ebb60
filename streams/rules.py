"""Rules (seed node 4): predictions + online features → explainable actions.

Conditions are rule-engine expressions (``label == 'bearing_wear' and confidence >= 0.8``),
parsed once at start — user text is never ``eval``-ed, and a malformed rule is
refused with its name and position. A rule reads the prediction's fields and
the device's latest window features from the online store (Redis). Each firing
becomes an Avro ``Action`` with a deterministic ``event_id`` (rule, device,
window), so a replay yields the same ids and subscribers can deduplicate.
A cooldown per device and action type (event time) keeps one fault from
flooding its subscribers.
"""

from __future__ import annotations

import hashlib
import logging
import re

import redis
import rule_engine
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from streams.avro import AvroCodec, WireFormatError
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, Output, Processor, Record, carry_headers, dead_letter
from streams.errors import TopologyError
from streams.features import online_prefix, read_online_features

log = logging.getLogger("tangram.rules")

FIRED = Counter("tangram_rules_fired_total", "Actions emitted per rule.", ["processor", "rule"])
SUPPRESSED = Counter("tangram_rules_suppressed_total", "Firings held back by the cooldown.", ["processor", "rule"])
UNEVALUABLE = Counter("tangram_rules_evaluation_errors_total", "Rules that could not be evaluated on a record.", ["processor", "rule"])

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_KEYWORDS = {"and", "or", "not", "true", "false", "null", "in", "if", "else", "for"}


class RuleSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    when: str = Field(description="A rule-engine expression over prediction fields and online features.")
    action: str = Field(description="The action type it emits (maintenance, alert, review, ...).")
    topic: str = Field(description="The action topic.")


class RulesSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rules: tuple[RuleSpec, ...] = Field(min_length=1)
    cooldown_ms: int = Field(30_000, ge=0, description="Per device and action type, in event time.")
    features_from: str = Field("features", description="The feature processor whose online features rules may read.")
    degradation_level: str = Field("L0", pattern=r"^L[0-3]$")

    @field_validator("rules")
    @classmethod
    def _unique(cls, rules: tuple[RuleSpec, ...]) -> tuple[RuleSpec, ...]:
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rule names must be unique: {names}")
        return rules


class CompiledRule:
    """A parsed rule; raises TopologyError naming the rule and the position of a syntax error."""

    _context = rule_engine.Context(default_value=None)

    def __init__(self, spec: RuleSpec):
        self.spec = spec
        try:
            self.rule = rule_engine.Rule(spec.when, context=self._context)
        except rule_engine.RuleSyntaxError as exc:
            where = f" at position {exc.token.lexpos}" if getattr(exc, "token", None) is not None else ""
            raise TopologyError(f"rule {spec.name!r}: syntax error{where} in {spec.when!r}: {exc.message}") from None
        except rule_engine.EngineError as exc:
            raise TopologyError(f"rule {spec.name!r}: {exc.message} in {spec.when!r}") from None
        code = _STRING.sub("", spec.when)
        self.symbols = tuple(dict.fromkeys(s for s in _IDENT.findall(code) if s not in _KEYWORDS))

    def matches(self, context: dict) -> bool:
        return bool(self.rule.matches(context))


def action_id(rule: str, device: str, window_end: int) -> str:
    return hashlib.sha256(f"{rule}|{device}|{window_end}".encode()).hexdigest()[:32]


class RuleProcessor(Processor):
    """``AnomalyPrediction`` → ``Action`` records on the action topics."""

    name = "rules"

    def __init__(self, *, input_codec: AvroCodec, output_codecs: dict[str, AvroCodec], dlq_topic: str,
                 redis_url: str, settings: RulesSettings, app: str):
        self.input_codec = input_codec
        self.output_codecs = output_codecs
        self.dlq_topic = dlq_topic
        self.settings = settings
        self.rules = [CompiledRule(spec) for spec in settings.rules]
        for rule in self.rules:
            if rule.spec.topic not in output_codecs:
                raise TopologyError(f"rule {rule.spec.name!r} emits to {rule.spec.topic!r}, not an output of the processor")
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self.features_prefix = online_prefix(app, settings.features_from)
        self._last_fired: dict[tuple[str, str], int] = {}  # (device, action) → window_end of the last firing

    @classmethod
    def build(cls, ctx: BuildContext) -> "RuleProcessor":
        (source,) = ctx.spec.inputs
        return cls(input_codec=ctx.codec(source), output_codecs={t: ctx.codec(t) for t in ctx.spec.outputs},
                   dlq_topic=ctx.dlq, redis_url=ctx.stack.redis_url,
                   settings=RulesSettings.model_validate(ctx.spec.params), app=ctx.topology.app)

    def setup(self) -> None:
        self.redis.ping()

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        decoded: list[tuple[Record, dict]] = []
        for record in batch:
            try:
                decoded.append((record, self.input_codec.decode(record.value)))
            except WireFormatError as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
        if not decoded:
            return outputs
        features = read_online_features(self.redis, [p["device_id"] for _, p in decoded], self.features_prefix)
        for (record, prediction), online in zip(decoded, features):
            context = {**online, **prediction}
            for rule in self.rules:
                try:
                    fired = rule.matches(context)
                except rule_engine.EngineError:
                    UNEVALUABLE.labels(self.name, rule.spec.name).inc()
                    continue
                if fired and (action := self._fire(rule, record, prediction, context)) is not None:
                    outputs.append(action)
        return outputs

    def _fire(self, rule: CompiledRule, record: Record, prediction: dict, context: dict) -> Output | None:
        spec, device, end = rule.spec, prediction["device_id"], prediction["window_end"]
        last = self._last_fired.get((device, spec.action))
        if last is not None and 0 <= end - last < self.settings.cooldown_ms:
            SUPPRESSED.labels(self.name, spec.name).inc()
            return None
        self._last_fired[(device, spec.action)] = end
        inputs = {s: float(context[s]) for s in rule.symbols if isinstance(context.get(s), (int, float))}
        shown = ", ".join(f"{s}={context[s]!r}" if not isinstance(context[s], float) else f"{s}={context[s]:.4g}"
                          for s in rule.symbols if s in context)
        action = {
            "event_id": action_id(spec.name, device, end),
            "action_type": spec.action,
            "device_id": device,
            "rule": spec.name,
            "reason": f"{spec.when} with {shown}",
            "inputs": inputs,
            "label": prediction["label"],
            "score": prediction["score"],
            "model_name": prediction["model_name"],
            "model_version": prediction["model_version"],
            "window_end": end,
            "degradation_level": self.settings.degradation_level,
            "trace_id": prediction["trace_id"],
        }
        FIRED.labels(self.name, spec.name).inc()
        headers = carry_headers(record, **{H_EVENT_ID: action["event_id"]})
        return Output(spec.topic, device, self.output_codecs[spec.topic].encode(action), headers)

    def close(self) -> None:
        self.redis.close()
