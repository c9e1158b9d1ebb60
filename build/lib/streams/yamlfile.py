"""Declarative files (topologies, feature sets): YAML read into a typed model, errors that name the field.

Imports only PyYAML and pydantic, so the Flink job environment can use it too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from streams.errors import TopologyError

M = TypeVar("M", bound=BaseModel)


def load_model(path: Path, model: type[M], what: str, fill: Callable[[dict], dict] | None = None) -> M:
    """``path`` parsed and validated as ``model``; TopologyError names the file and each offending field.

    ``fill`` completes a mapping before validation with what the file implies (e.g. its folder).
    """
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"{what} file {path} does not exist") from None
    except IsADirectoryError:
        raise TopologyError(f"{path} is a folder, not a {what} file") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML: {exc}") from exc
    if fill is not None and isinstance(raw, dict):
        raw = fill(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}" for e in exc.errors())
        raise TopologyError(f"{path}: {problems}") from exc
