"""Version routing: which model version scores which record (production, canary, shadow).

A :class:`VersionRouting` holds the current :class:`RoutingSettings` and swaps them atomically;
the inference worker reads one snapshot per micro-batch, so a switch takes effect between
batches and never splits one. The settings come from the topology's processor params, from a
``routing_file`` re-read on change (:class:`RoutingFile`), or from the model registry on its
compacted topic; the worker has Triton load the versions a new routing needs before it switches,
and unload the ones it no longer routes after (explicit model control, see the worker).

- ``canary``: a stable share of the *keys* (entities) is scored by the challenger instead of the
  production version. The share is decided by a hash of the key, so one device always goes to
  the same version while the share is unchanged, and raising the share only moves devices from
  production to the challenger, never back.
- ``shadow``: every record is scored by production (acted on) and a copy by the challenger,
  whose predictions go to a shadow topic that no rule reads.

A version is written ``"2"`` (a version of the worker's model; Triton serves several versions of one
name side by side, the local CPU Triton included) or ``"other_model:1"`` (another Triton model name
and its version).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streams.statelog import entity_share

log = logging.getLogger("tangram.inference.routing")


@dataclasses.dataclass(frozen=True, order=True)
class ModelTarget:
    """One servable model version: Triton model name and version."""

    model: str
    version: str

    @classmethod
    def parse(cls, text: str, default_model: str) -> "ModelTarget":
        """``"2"`` → (default_model, "2"); ``"other_model:1"`` → ("other_model", "1")."""
        model, sep, version = text.rpartition(":")
        if not sep:
            model = default_model
        if not model or not version.isdigit():
            raise ValueError(f"model version {text!r}: expected '<version>' or '<model>:<version>' (version a number)")
        return cls(model, version)

    def __str__(self) -> str:
        return f"{self.model}:{self.version}"


class RoutingSettings(BaseModel):
    """Production and challenger versions and how records are shared between them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    production: str = Field("1", description="Version whose predictions are acted on: '2' or 'model:2'.")
    challenger: str | None = Field(None, description="Version under evaluation, or none.")
    mode: Literal["canary", "shadow"] = Field("canary", description="canary: a share of keys; shadow: a copy of all.")
    canary_share: float = Field(0.0, ge=0.0, le=1.0, description="Share of keys the challenger scores (canary).")

    @model_validator(mode="after")
    def _versions_parse(self) -> "RoutingSettings":
        for text in (self.production, self.challenger):
            if text is not None:
                ModelTarget.parse(text, "model")
        if self.challenger is not None and self.challenger == self.production:
            raise ValueError(f"challenger {self.challenger!r} is the production version")
        return self


def key_bucket(key: str | bytes | None) -> float:
    """A stable number in [0, 1) for ``key``: :func:`streams.statelog.entity_share`, the one entity hash
    of the project (the first 8 bytes of a SHA-256), so the worker and the model registry agree on
    which entities fall in a canary share."""
    entity = key.decode("utf-8", "replace") if isinstance(key, bytes) else (key or "")
    return entity_share(entity)


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """One immutable snapshot of the routing, resolved to Triton targets."""

    production: ModelTarget
    challenger: ModelTarget | None
    mode: Literal["canary", "shadow"]
    canary_share: float

    @property
    def targets(self) -> tuple[ModelTarget, ...]:
        return (self.production,) if self.challenger is None else (self.production, self.challenger)

    def canary_mask(self, keys: Sequence[str | bytes | None]) -> np.ndarray:
        """True where the challenger scores the key instead of production (canary mode only)."""
        if self.challenger is None or self.mode != "canary" or self.canary_share <= 0.0:
            return np.zeros(len(keys), dtype=bool)
        return np.fromiter((key_bucket(k) < self.canary_share for k in keys), dtype=bool, count=len(keys))

    @property
    def shadow(self) -> bool:
        return self.challenger is not None and self.mode == "shadow"

    def describe(self) -> str:
        if self.challenger is None:
            return f"production {self.production}"
        if self.mode == "shadow":
            return f"production {self.production}, shadow {self.challenger}"
        return f"production {self.production}, canary {self.challenger} at {self.canary_share:.1%} of keys"


def resolve(settings: RoutingSettings, default_model: str) -> RoutingPlan:
    return RoutingPlan(
        production=ModelTarget.parse(settings.production, default_model),
        challenger=None if settings.challenger is None else ModelTarget.parse(settings.challenger, default_model),
        mode=settings.mode,
        canary_share=settings.canary_share,
    )


class VersionRouting:
    """The current routing plan, swapped atomically; readers take one snapshot per batch."""

    def __init__(self, settings: RoutingSettings, default_model: str):
        self.default_model = default_model
        self._lock = threading.Lock()
        self._plan = resolve(settings, default_model)

    @property
    def plan(self) -> RoutingPlan:
        with self._lock:
            return self._plan

    def candidate(self, settings: RoutingSettings) -> RoutingPlan:
        """The plan ``settings`` would give, without switching to it (the worker checks its targets first)."""
        return resolve(settings, self.default_model)

    def switch(self, plan: RoutingPlan) -> RoutingPlan:
        """Make ``plan`` current; returns the previous one."""
        with self._lock:
            previous, self._plan = self._plan, plan
        if previous != plan:
            log.info("routing: %s (was %s)", plan.describe(), previous.describe())
        return previous


class RoutingFile:
    """A JSON file of :class:`RoutingSettings`, re-read when its modification time or size changes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None

    def poll(self) -> RoutingSettings | None:
        """New settings if the file changed since the last call (the first call reads it), else None.

        A file that is missing or invalid is reported and ignored: the current routing stays.
        """
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            return RoutingSettings.model_validate(json.loads(self.path.read_text()))
        except (OSError, ValueError, ValidationError) as exc:
            log.error("routing file %s ignored, the current routing stays: %s", self.path, exc)
            return None

