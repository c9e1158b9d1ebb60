"""Plan-time check: every rule of every rule processor of a topology compiles and has somewhere to go.

``tangram plan`` / ``apply`` refuse a topology with a malformed rule before anything is deployed;
each message names the processor, the rule, its place in the rule set, the position and the reason.
"""

from __future__ import annotations

from pydantic import ValidationError

from streams.errors import TangramError
from streams.rules.engine import RuleBook
from streams.rules.spec import RulesSettings
from streams.topology import Kind, Topology


def rule_problems(topology: Topology) -> list[str]:
    """One message per problem in the rule processors' ``params`` (an empty list: all rules compile)."""
    problems = []
    for name, spec in topology.processors.items():
        if spec.kind != Kind.RULES:
            continue
        try:
            settings = RulesSettings.model_validate(spec.params)
        except ValidationError as exc:
            problems += [f"processor {name!r}: params.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                         for e in exc.errors()]
            continue
        try:
            RuleBook.build(settings.rules, "topology", 0, settings.topics(spec.outputs))
            settings.safe_topic(spec.outputs)
        except TangramError as exc:
            problems.append(f"processor {name!r}: {exc}")
    return problems
