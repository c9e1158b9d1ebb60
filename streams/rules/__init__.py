"""Rules (seed node 4, the business orchestrator): predictions + features → explainable actions.

* :mod:`streams.rules.spec`: rules, fusion, degradation as frozen settings models (topology and config center);
* :mod:`streams.rules.engine`: compiled rules (rule-engine expressions, never ``eval``), priorities, action ids;
* :mod:`streams.rules.fusion`: several models' predictions of one entity and window → one (weighted, max, vote);
* :mod:`streams.rules.degradation`: golden signals, triggers with hysteresis, the L0–L3 level in effect;
* :mod:`streams.rules.vector`: a compiled rule over a batch's columns at once (numpy, three-valued per row);
* :mod:`streams.rules.evaluation`: a level's rules over a batch's records → actions, dead letters, safe defaults;
* :mod:`streams.rules.memory`: one path per entity window, repeats and cooldowns;
* :mod:`streams.rules.online_reads`: the entities' online features, read from the features processor's rows;
* :mod:`streams.rules.actions`: the action records and what they carry of the record decided on;
* :mod:`streams.rules.processor`: :class:`RuleProcessor`, the stream processor;
* :mod:`streams.rules.check`: the plan-time check that compiles every rule of a topology.
"""

from streams.rules.engine import CompiledRule, RuleBook, action_id, compile_rules
from streams.rules.spec import (DegradationSpec, FusionMember, FusionSpec, RuleSetValue, RuleSpec, RulesSettings,
                                SafeDefault, Trigger)

__all__ = ["CompiledRule", "DegradationSpec", "FusionMember", "FusionSpec", "RuleBook", "RuleProcessor", "RuleSetValue",
           "RuleSpec", "RulesSettings", "SafeDefault", "Trigger", "action_id", "compile_rules"]


def __getattr__(name: str):
    """``RuleProcessor`` loads Kafka/Redis clients: import it on first use (PEP 562)."""
    if name == "RuleProcessor":
        from streams.rules.processor import RuleProcessor

        return RuleProcessor
    raise AttributeError(f"module 'streams.rules' has no attribute {name!r}")
