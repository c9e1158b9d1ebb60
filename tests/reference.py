"""Where the reference apps live, for the tests: the runtime itself knows no app.

``tests/conftest.py`` puts this folder and the app folders on the import path, so tests import
``reference`` and the apps' plugin code (``pm_app``) the way the runtime does from a topology.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from streams.topology import Topology, load_topology

REPO = Path(__file__).resolve().parent.parent
#: The predictive-maintenance app: its folder and its topology file.
PM = REPO / "topologies" / "predictive_maintenance"
PM_TOPOLOGY = PM / "topology.yaml"
#: The document-intake app (OCR on Triton): its folder.
INTAKE = REPO / "topologies" / "document_intake"
#: The same app folder as the image holds it (the Dockerfile copies topologies/ and schemas/ under /app).
APP = "topologies/predictive_maintenance"
IMAGE_APP = f"/app/{APP}"
#: The contracts of the reference apps.
SCHEMAS = REPO / "schemas" / "avro"


@cache
def pm_topology() -> Topology:
    return load_topology(PM)


def load_schema(subject: str) -> dict:
    """A reference app's Avro schema by subject."""
    return json.loads((SCHEMAS / f"{subject}.avsc").read_text())


def pm_doc() -> dict:
    """The reference topology as a mapping, its folder set (``root``), for tests that build variants of it."""
    import yaml

    return {**yaml.safe_load(PM_TOPOLOGY.read_text()), "root": str(PM)}
