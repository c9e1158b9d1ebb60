"""`tangram apply` on the real broker and registry: idempotent, and the declared compatibility levels are set."""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from streams.plan import apply, plan
from reference import SCHEMAS
from streams.schemas_check import load_levels
from streams.topology import load_topology

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def test_apply_is_idempotent_and_sets_each_subjects_compatibility(stack, tmp_path):
    path, _ = isolated_topology(tmp_path)
    topology = load_topology(path)
    first = apply(topology, stack)
    assert {c.kind for c in first} >= {"create-topic"}
    assert plan(topology, stack) == []  # nothing left to change
    assert apply(topology, stack) == []
    registry = SchemaRegistryClient({"url": stack.registry_url})
    levels = load_levels(SCHEMAS)
    for subject in topology.subjects():
        assert registry.get_compatibility(subject) == levels.level(subject)
    assert registry.get_compatibility("pm.ingest.telemetry-value") == "FULL_TRANSITIVE"
    # an operator loosens a level by hand: plan notices, apply restores the declared one
    registry.set_compatibility(subject_name="pm.ingest.telemetry-value", level="NONE")
    [drift] = plan(topology, stack)
    assert (drift.kind, drift.target, drift.detail) == ("set-compatibility", "pm.ingest.telemetry-value", "NONE → FULL_TRANSITIVE")
    apply(topology, stack)
    assert registry.get_compatibility("pm.ingest.telemetry-value") == "FULL_TRANSITIVE"
