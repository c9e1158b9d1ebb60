"""Each integration test gets its own topics and consumer groups: a renamed copy of a topology."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from reference import PM_TOPOLOGY as REFERENCE
from streams.namespace import rooted
_TOPIC = re.compile(r"\bpm\.(raw|ingest|features|predictions|actions|dlq|sim|monitor)\.([a-z_]+)\b(?!-value)")


def isolated_topology(tmp_path: Path, source: Path = REFERENCE) -> tuple[Path, str]:
    """Copy ``source`` with every ``pm.*`` topic and the app name under a fresh prefix."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    text = _TOPIC.sub(lambda m: f"{prefix}.{m.group(1)}.{m.group(2)}", rooted(source.read_text(), source.parent))
    text = re.sub(r"^app: pm$", f"app: {prefix}", text, flags=re.M)
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(text)
    return path, prefix
