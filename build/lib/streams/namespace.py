"""Namespaces: a copy of a topology whose topics and consumer groups all carry another prefix.

Replays, backtests and tests run a topology beside the live one this way: every
topic the topology declares (``pm.ingest.telemetry``) is renamed under the
namespace (``bt1a2b.ingest.telemetry``) wherever it appears — topic keys,
processor inputs and outputs, rule targets — and the app name becomes the
prefix, so consumer groups (``<app>.<processor>``) and online-store keys differ
too. Nothing of the live topology is read as, committed to, or written. The copy may live
anywhere: it names the app folder it came from (``root:``), so its relative paths (schemas,
feature sets, models, plugin code) still resolve there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from streams.errors import TopologyError
from streams.topology import topology_file

#: An override value that removes the key instead of setting it.
DELETE = object()


def rooted(text: str, folder: Path) -> str:
    """``text`` of a topology with ``root: <folder>`` after its ``app:`` line, unless it sets a root already."""
    if yaml.safe_load(text).get("root") is not None:
        return text
    return re.sub(r"^(app: .*)$", lambda m: f"{m.group(1)}\nroot: {folder.resolve()}", text, count=1, flags=re.M)


def rename_topics(text: str, app: str, topics: list[str], prefix: str) -> str:
    """``text`` with each ``<app>.x.y`` topic name replaced by ``<prefix>.x.y`` (not schema subjects)."""
    for topic in sorted(topics, key=len, reverse=True):
        if not topic.startswith(f"{app}."):
            raise TopologyError(f"topic {topic!r} does not start with the app name {app!r}; cannot namespace it")
        renamed = prefix + topic[len(app):]
        text = re.sub(rf"(?<![\w.-]){re.escape(topic)}(?![\w-])", renamed, text)
    return re.sub(rf"^app: {re.escape(app)}\s*$", f"app: {prefix}", text, flags=re.M)


def namespaced(source: Path, prefix: str, target: Path, overrides: dict[str, Any] | None = None) -> Path:
    """Write ``source`` under namespace ``prefix`` to ``target``; ``overrides`` maps ``a/b/c`` paths to values (or ``DELETE``)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", prefix):
        raise TopologyError(f"namespace {prefix!r} must be lowercase letters, digits and _ and start with a letter")
    source = topology_file(source)
    text = rooted(source.read_text(), source.parent)
    doc = yaml.safe_load(text)
    text = rename_topics(text, doc["app"], list(doc.get("topics", {})), prefix)
    if overrides:
        doc = yaml.safe_load(text)
        for path, value in overrides.items():
            *parents, leaf = path.split("/")
            node = doc
            for part in parents:
                node = node.setdefault(part, {})
            if value is DELETE:
                node.pop(leaf, None)
            else:
                node[leaf] = value
        text = yaml.safe_dump(doc, sort_keys=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target
