"""The declared schema of every config value, by namespace and key pattern.

The seeds name four namespaces (node 5); each value is validated against its declaration
before it is published, and again by every subscriber before it is applied, so an invalid
value never reaches a processor:

| namespace | what | default declaration |
|---|---|---|
| ``model-config`` | model serving: endpoint, timeout, retries, batch | :class:`ModelServingConfig` |
| ``feature-switch`` | on/off switches; ``degradation.level`` is the L0–L3 switch | ``bool``; ``"L0"``…``"L3"`` |
| ``business-rule`` | rule sets (conditions → actions) | ``streams.rules.spec:RuleSetValue`` (compiled) |
| ``monitor-threshold`` | alert thresholds (``latency_p95_ms`` …) | a finite number |
| ``gateway-key`` | the gateways' API keys, hashed (``tangram keys``) | ``streams.security.keys:ApiKey`` |

A declaration's type is a Python type (pydantic model, ``Literal``, ``bool``…) or a
``"module:Attr"`` string resolved on first use, so a processor package can own the schema of
its keys without an import cycle: the rule processor declares its own rule-set model by inserting
one :class:`Declaration` into :data:`DEFAULT_DECLARATIONS` (before the catch-all ``*``). The first declaration whose key
pattern (``fnmatch``) matches wins.
"""

from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, ValidationError, model_validator

from streams.errors import ConfigValidationError

NAMESPACES: tuple[str, ...] = ("model-config", "feature-switch", "business-rule", "monitor-threshold", "gateway-key")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelServingConfig(_Frozen):
    """``model-config/<model>``: how processors call a model service."""

    endpoint: str | None = Field(None, description="host:port of the model server, if not the stack's.")
    timeout_ms: int = Field(2000, gt=0, le=60_000, description="Deadline of one inference call.")
    retries: int = Field(3, ge=0, le=10)
    max_batch_size: int | None = Field(None, ge=1, le=100_000)


class RuleConfig(_Frozen):
    """One rule of a rule set: a condition over prediction fields and features, and the action it emits."""

    name: str = Field(min_length=1)
    when: str = Field(min_length=1, description="Condition expression (evaluated safely by the rule processor).")
    action: str = Field(min_length=1, description="Action kind / topic suffix, e.g. maintenance.")
    priority: int = 0
    cooldown_s: float = Field(0.0, ge=0)
    enabled: bool = True


class RuleSetConfig(_Frozen):
    """``business-rule/<rule set>``: rules evaluated in priority order."""

    rules: list[RuleConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> RuleSetConfig:
        names = [r.name for r in self.rules]
        if len(names) != len(set(names)):
            raise ValueError(f"rule names must be unique, got {names}")
        return self


DegradationLevel = Literal["L0", "L1", "L2", "L3"]
Threshold = Annotated[float, Field(allow_inf_nan=False, strict=True)]


@dataclass(frozen=True)
class Declaration:
    """The schema of the values under ``namespace`` whose key matches ``pattern``."""

    namespace: str
    pattern: str
    type_: Any  # a type, or "module:Attr" resolved on first use
    description: str = ""
    _adapter: list[TypeAdapter] = field(default_factory=list, compare=False, repr=False)

    def adapter(self) -> TypeAdapter:
        if not self._adapter:
            t = self.type_
            if isinstance(t, str):
                module, _, attr = t.partition(":")
                t = getattr(importlib.import_module(module), attr)
            self._adapter.append(TypeAdapter(t))
        return self._adapter[0]


DEFAULT_DECLARATIONS: list[Declaration] = [
    Declaration("model-config", "*", ModelServingConfig, "serving settings of a model"),
    Declaration("feature-switch", "degradation.level", DegradationLevel, "manual degradation level L0–L3"),
    Declaration("feature-switch", "*", StrictBool, "an on/off switch"),
    Declaration("business-rule", "*", "streams.rules.spec:RuleSetValue",
                "a rule set of the rule processor; every rule must compile"),
    Declaration("monitor-threshold", "*", Threshold, "an alert threshold (finite number)"),
    Declaration("gateway-key", "*", "streams.security.keys:ApiKey",
                "a gateway API key: identity, scopes, limits and the SHA-256 of its secret"),
]


class ConfigSchemas:
    """Validates a namespace/key/value triple against its declaration."""

    def __init__(self, declarations: list[Declaration] | None = None) -> None:
        self.declarations = DEFAULT_DECLARATIONS if declarations is None else list(declarations)

    def with_declaration(self, declaration: Declaration) -> ConfigSchemas:
        """A copy where ``declaration`` comes before every existing one."""
        return ConfigSchemas([declaration, *self.declarations])

    def declaration(self, namespace: str, key: str) -> Declaration:
        if namespace not in {d.namespace for d in self.declarations}:
            known = ", ".join(dict.fromkeys(d.namespace for d in self.declarations))
            raise ConfigValidationError(f"unknown namespace {namespace!r}; namespaces are {known}")
        for d in self.declarations:
            if d.namespace == namespace and fnmatch.fnmatchcase(key, d.pattern):
                return d
        raise ConfigValidationError(f"{namespace}/{key}: no schema is declared for this key")

    def validate(self, namespace: str, key: str, value: Any) -> Any:
        """The value in its canonical JSON form; ConfigValidationError naming the key and the problem."""
        if not key or key != key.strip() or "/" in key:
            raise ConfigValidationError(f"{namespace}/{key!r}: a key is a non-empty name without spaces or '/'")
        d = self.declaration(namespace, key)
        adapter = d.adapter()
        try:
            return adapter.dump_python(adapter.validate_python(value), mode="json")
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
            raise ConfigValidationError(f"{namespace}/{key}: {problems} (schema: {d.description or d.type_})") from None


DEFAULT_SCHEMAS = ConfigSchemas()
