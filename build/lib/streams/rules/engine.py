"""Compiled rules: safe expressions (rule-engine, never ``eval``), priorities, deterministic action ids.

A :class:`RuleBook` is one immutable, compiled version of a rule set. The processor swaps the
whole book between micro-batches when the config center publishes a new one, so every record
of a batch is decided by exactly one version.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import rule_engine

from streams.errors import TopologyError
from streams.rules.spec import Level, RuleSpec

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_KEYWORDS = {"and", "or", "not", "true", "false", "null", "in", "if", "else", "for"}


class CompiledRule:
    """A parsed rule; raises TopologyError naming the rule, the position of a syntax error and the reason."""

    _context = rule_engine.Context(default_value=None)

    def __init__(self, spec: RuleSpec, position: int | None = None):
        self.spec = spec
        self.topic: str = spec.topic or ""  # resolved by RuleBook.build
        where_rule = f"rule {spec.name!r}" + (f" (#{position + 1} of its rule set)" if position is not None else "")
        try:
            self.rule = rule_engine.Rule(spec.when, context=self._context)
        except rule_engine.RuleSyntaxError as exc:
            token = getattr(exc, "token", None)
            where = f" at position {token.lexpos}" if token is not None else f" at position {len(spec.when)} (end)"
            raise TopologyError(f"{where_rule}: syntax error{where} in {spec.when!r}: {exc.message}") from None
        except rule_engine.EngineError as exc:
            raise TopologyError(f"{where_rule}: {exc.message} in {spec.when!r}") from None
        code = _STRING.sub("", spec.when)
        self.symbols = tuple(dict.fromkeys(s for s in _IDENT.findall(code) if s not in _KEYWORDS))

    def matches(self, context: dict) -> bool:
        return bool(self.rule.matches(context))


def compile_rules(specs: Iterable[RuleSpec]) -> list[CompiledRule]:
    """Compile every rule; the first error names the rule, its place in the set, the position and the reason."""
    return [CompiledRule(spec, i) for i, spec in enumerate(specs)]


def action_id(rule: str, entity: str, time: int) -> str:
    """Deterministic id of an action: the same rule on the same entity and time gives the same id."""
    return hashlib.sha256(f"{rule}|{entity}|{time}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RuleBook:
    """One compiled version of a rule set, ordered by priority (highest first, then declaration order)."""

    rules: tuple[CompiledRule, ...]
    source: str  # "topology" or "config v<N>"
    version: int  # 0 for the topology's rules, else the config center's version

    @classmethod
    def build(cls, specs: Iterable[RuleSpec], source: str, version: int, topics: dict[str, str]) -> RuleBook:
        """Compile ``specs``; ``topics`` maps action types (and output topics) to topics (rules may name one)."""
        compiled = compile_rules(specs)
        for rule in compiled:
            topic = rule.spec.topic or topics.get(rule.spec.action)
            if topic is None or topic not in topics.values():
                raise TopologyError(f"rule {rule.spec.name!r} emits {rule.spec.action!r} to "
                                    f"{rule.spec.topic or '(no topic)'}, which is not an output of the processor "
                                    f"(outputs: {', '.join(sorted(set(topics.values())))})")
            rule.topic = topic
        ordered = sorted((r for r in compiled if r.spec.enabled), key=lambda r: -r.spec.priority)
        return cls(tuple(ordered), source, version)

    @property
    def label(self) -> str:
        return self.source

    def at(self, level: Level) -> tuple[CompiledRule, ...]:
        """The rules that run at ``level``."""
        return tuple(r for r in self.rules if level in r.spec.levels)
