"""Each integration test gets its own topics and consumer groups: a renamed copy of a topology."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import yaml
from reference import PM_TOPOLOGY as REFERENCE

from streams.namespace import rooted

_TOPIC = re.compile(r"\bpm\.((?:raw|ingest|features|predictions|actions|dlq|sim|monitor)\.[a-z_]+|devices)\b(?!-value)")


def isolated_topology(tmp_path: Path, source: Path = REFERENCE, *, own_state: bool = False) -> tuple[Path, str]:
    """Copy ``source`` with every ``pm.*`` topic and the app name under a fresh prefix.

    ``own_state``: the inference workers follow a model registry and a config center of their own
    (``_tangram.models.<prefix>``, empty: the declared version), not the stack's, which other tests
    promote, roll back and degrade."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    text = _TOPIC.sub(lambda m: f"{prefix}.{m.group(1)}", rooted(source.read_text(), source.parent))
    text = re.sub(r"^app: pm$", f"app: {prefix}", text, flags=re.M)
    if own_state:
        doc = yaml.safe_load(text)
        for spec in doc["processors"].values():
            if spec["kind"] == "inference_workers.worker:InferenceWorker":
                spec.setdefault("params", {}).update(registry_topic=f"_tangram.models.{prefix}",
                                                     config_topic=f"_tangram.config.{prefix}")
        text = yaml.safe_dump(doc, sort_keys=False)
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(text)
    return path, prefix
