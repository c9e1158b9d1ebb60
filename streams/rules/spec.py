"""The declarative side of the rule processor: rules, fusion, degradation, as frozen settings models.

Everything here is plain data validated by pydantic. The same :class:`RuleSpec` is used by
the topology (``processors.<name>.params.rules``) and by the config center
(``business-rule/<rule set>``, validated through :class:`RuleSetValue`), so a rule set written
in either place means the same thing and is refused for the same reasons.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from streams.errors import TopologyError

Level = Literal["L0", "L1", "L2", "L3"]
LEVELS: tuple[Level, ...] = ("L0", "L1", "L2", "L3")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RuleSpec(_Frozen):
    """One rule: a condition, the action it emits, where, and when it runs."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    when: str = Field(min_length=1, description="A rule-engine expression over prediction fields and online features.")
    action: str = Field(min_length=1, description="The action type it emits (maintenance, alert, review, ...).")
    topic: str | None = Field(None, description="The action topic; default the processor's `actions` entry for it.")
    priority: int = Field(0, description="Higher runs first; of the rules of one action type that match a record, "
                                         "only the highest-priority one fires.")
    cooldown_s: float | None = Field(None, ge=0, description="Per entity and action type (event time); "
                                                             "default the processor's `cooldown_ms`.")
    enabled: bool = True
    levels: tuple[Level, ...] = Field(("L0", "L1"), min_length=1, description=(
        "Degradation levels it runs at. At L0/L1 a rule reads a prediction and the entity's online features; "
        "at L2 it reads the feature window only (no model: prediction fields are null); at L3 only the safe "
        "default runs."))

    @field_validator("levels")
    @classmethod
    def _no_l3(cls, levels: tuple[Level, ...]) -> tuple[Level, ...]:
        if "L3" in levels:
            raise ValueError("no rule runs at L3: declare `degradation.safe_default` instead")
        return levels


def _unique(rules: tuple[RuleSpec, ...]) -> tuple[RuleSpec, ...]:
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"rule names must be unique, repeated: {', '.join(dupes)}")
    return rules


class FusionMember(_Frozen):
    model: str = Field(min_length=1, description="`model_name` of the member's predictions.")
    weight: float = Field(1.0, gt=0, description="Weight in `weighted` fusion and in `vote` ties.")
    expensive: bool = Field(False, description="Switched off at degradation level L1 and above.")


class FusionSpec(_Frozen):
    """Combine several models' predictions of one entity and window into one."""

    members: tuple[FusionMember, ...] = Field(min_length=2)
    method: Literal["weighted", "max", "vote"] = "weighted"
    wait_ms: int = Field(2000, ge=0, le=60_000, description="Longest wait (wall clock) for late members; "
                                                            "then the fusion emits with what it has.")
    min_members: int = Field(1, ge=1, description="Fewer members than this after the wait: no decision.")

    @model_validator(mode="after")
    def _distinct(self) -> FusionSpec:
        models = [m.model for m in self.members]
        if len(set(models)) != len(models):
            raise ValueError(f"fusion members must be distinct models, got {models}")
        return self


class SafeDefault(_Frozen):
    """What the processor emits at L3, once per entity and cooldown, for every feature window."""

    action: str = Field(min_length=1)
    topic: str | None = Field(None, description="Default: the processor's `actions` entry for the action.")
    reason: str = "degradation level L3: the declared safe default"


Signal = Literal["missing_predictions", "inference_p99_ms", "prediction_age_s"]


class Trigger(_Frozen):
    """Raise the level to ``level`` while a golden signal is bad; release it with hysteresis."""

    signal: Signal = Field(description=(
        "missing_predictions: share of recent feature windows with no prediction after `prediction_wait_ms`; "
        "inference_p99_ms: p99 of the predictions' `inference_ms`; "
        "prediction_age_s: wall seconds since the newest prediction while feature windows keep arriving."))
    above: float = Field(description="Enter when the signal is above this.")
    below: float = Field(description="Leave only once the signal is below this ...")
    hold_s: float = Field(10.0, ge=0, description="... for this long without interruption.")
    level: Level

    @model_validator(mode="after")
    def _hysteresis(self) -> Trigger:
        if self.below > self.above:
            raise ValueError(f"`below` ({self.below}) must not exceed `above` ({self.above}): that is the hysteresis")
        if self.level == "L0":
            raise ValueError("a trigger raises the level above L0")
        return self


class DegradationSpec(_Frozen):
    window_s: float = Field(10.0, gt=0, description="Golden signals are measured over this sliding window.")
    prediction_wait_ms: int = Field(3000, ge=0, description="A feature window without a prediction after this "
                                                            "long counts as missing.")
    min_samples: int = Field(3, ge=1, description="Fewer observations than this in the window: no verdict.")
    triggers: tuple[Trigger, ...] = ()
    safe_default: SafeDefault | None = None
    switch: str = Field("degradation.level", description="The manual switch in the config center's feature-switch.")


class RulesSettings(_Frozen):
    """``params`` of a rule processor in the topology."""

    rules: tuple[RuleSpec, ...] = Field(min_length=1)
    entity_field: str = Field(description="The field naming the entity in the inputs and the actions (the Kafka key).")
    time_field: str = Field("window_end", description="The event time a decision is about (epoch ms), in the inputs "
                                                      "and the actions: cooldowns and one decision per entity and time.")
    actions: dict[str, str] = Field(default_factory=dict, description="Action type → its topic (one of the outputs), "
                                                                     "for rules and the safe default that name none.")
    cooldown_ms: int = Field(30_000, ge=0, description="Per entity and action type, in event time.")
    features_from: str | None = Field(None, description="The feature processor whose online features rules may read; "
                                                        "none: rules read the record only.")
    online_wait_ms: int = Field(10_000, ge=0, description="A prediction of an entity without online features yet waits "
                                                          "this long for the feature stage to write them (the batch is "
                                                          "held back), then is decided without them; 0: no wait.")
    degradation_level: Level = Field("L0", description="The manual level until the config center says otherwise.")
    rule_set: str | None = Field(None, description="Key in the config center's business-rule namespace that overrides "
                                                   "`rules`; default `<app>.<processor>`.")
    config_topic: str = Field("_tangram.config", description="The config center's topic.")
    live_config: bool = Field(True, description="Follow the config center (rule sets, the manual level).")
    fusion: FusionSpec | None = None
    degradation: DegradationSpec = DegradationSpec()

    @field_validator("rules")
    @classmethod
    def _unique_rules(cls, rules: tuple[RuleSpec, ...]) -> tuple[RuleSpec, ...]:
        return _unique(rules)

    def topics(self, outputs: list[str]) -> dict[str, str]:
        """Where an action goes: each action type of ``actions`` and each output topic → its topic.

        Raises TopologyError when ``actions`` names a topic that is not one of ``outputs``."""
        unknown = {a: t for a, t in self.actions.items() if t not in outputs}
        if unknown:
            raise TopologyError(f"`actions` names topics that are not outputs of the processor: {unknown}")
        return {**self.actions, **{t: t for t in outputs}}

    def safe_topic(self, outputs: list[str]) -> str | None:
        """The safe default's topic (None without a safe default); TopologyError when it has none among ``outputs``."""
        safe = self.degradation.safe_default
        if safe is None:
            return None
        topic = safe.topic or self.actions.get(safe.action)
        if topic not in outputs:
            raise TopologyError(f"safe default {safe.action!r} has no output topic (outputs: {', '.join(outputs)})")
        return topic

    @model_validator(mode="after")
    def _l3_needs_default(self) -> RulesSettings:
        if self.degradation_level == "L3" and self.degradation.safe_default is None:
            raise ValueError("degradation_level L3 needs `degradation.safe_default`")
        if any(t.level == "L3" for t in self.degradation.triggers) and self.degradation.safe_default is None:
            raise ValueError("a trigger to L3 needs `degradation.safe_default`")
        return self


class RuleSetValue(_Frozen):
    """``business-rule/<rule set>`` in the config center: every rule is compiled before it is published."""

    rules: tuple[RuleSpec, ...] = Field(min_length=1)

    @field_validator("rules")
    @classmethod
    def _unique_rules(cls, rules: tuple[RuleSpec, ...]) -> tuple[RuleSpec, ...]:
        return _unique(rules)

    @model_validator(mode="after")
    def _compiles(self) -> RuleSetValue:
        from streams.rules.engine import compile_rules  # the expression engine, imported lazily

        try:
            compile_rules(self.rules)
        except TopologyError as exc:
            raise ValueError(str(exc)) from None
        return self
