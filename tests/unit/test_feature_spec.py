"""The feature-set declaration: it reproduces the model's contract and refuses inconsistent files."""

from __future__ import annotations


import pytest
import yaml

from pm_app import FEATURE_NAMES, FEATURE_SET
from reference import PM, pm_topology
from streams.errors import TopologyError
from streams.features.spec import FeatureSet, WindowSpec, load_feature_set

DEFAULT_FEATURE_SET = PM / "features" / "device_window.yaml"

#: The model's input vector as trained and served before the declaration existed: never reorder.
CONTRACT = (
    "missing_rate",
    "temperature_mean", "temperature_std", "temperature_min", "temperature_max", "temperature_ptp",
    "vibration_mean", "vibration_std", "vibration_min", "vibration_max", "vibration_ptp",
    "current_mean", "current_std", "current_min", "current_max", "current_ptp",
    "pressure_mean", "pressure_std", "pressure_min", "pressure_max", "pressure_ptp",
    "rpm_mean", "rpm_std", "rpm_min", "rpm_max", "rpm_ptp",
    "vibration_band_energy",
    # appended with the fleet register's attributes (issue #24): the rated values of the window's device
    "rated_temperature", "rated_current", "rated_rpm",
)


def test_the_declaration_reproduces_the_feature_names_in_order():
    assert FEATURE_NAMES == CONTRACT
    assert load_feature_set(DEFAULT_FEATURE_SET).feature_names == CONTRACT


def test_the_declaration_matches_the_output_avro_schema_field_by_field():
    schema = pm_topology().schema(FEATURE_SET.output.schema_)
    assert tuple(f["name"] for f in schema["fields"]) == FEATURE_SET.columns
    assert all(f["type"] == "double" for f in schema["fields"] if f["name"] in FEATURE_NAMES)


def test_the_declaration_names_the_topics_of_the_reference_topology():
    topology = pm_topology()
    spec = topology.processors["features"]
    assert spec.inputs == [FEATURE_SET.source.topic] and spec.outputs == [FEATURE_SET.output.topic]
    assert topology.topics[FEATURE_SET.source.topic].schema_ == FEATURE_SET.source.schema_
    assert load_feature_set(topology.path(spec.params["feature_set"])) == FEATURE_SET


def test_window_ttl_owner_and_ranges_are_declared():
    assert (FEATURE_SET.window.size_ms, FEATURE_SET.window.hop_ms, FEATURE_SET.window.allowed_lateness_ms) == (5000, 5000, 1000)
    assert FEATURE_SET.online.ttl_s == 3600 and FEATURE_SET.owner and FEATURE_SET.entity.join_key == "device_id"
    ranges = FEATURE_SET.feature_ranges()
    assert set(ranges) == set(FEATURE_NAMES)
    assert ranges["missing_rate"] == (0.0, 1.0) and ranges["temperature_mean"] == (-40.0, 200.0)
    assert ranges["rpm_ptp"] == (0.0, 10000.0) and ranges["vibration_std"] == (0.0, 50.0)


def test_round_trip_yaml_to_model_to_yaml():
    raw = yaml.safe_load(DEFAULT_FEATURE_SET.read_text())
    again = FeatureSet.model_validate(yaml.safe_load(yaml.safe_dump(FEATURE_SET.model_dump(mode="json", by_alias=True))))
    assert again == FEATURE_SET == FeatureSet.model_validate(raw)


def _with(**changes) -> dict:
    raw = yaml.safe_load(DEFAULT_FEATURE_SET.read_text())
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"window": {"size_ms": 5000, "hop_ms": 3000}}, "must divide"),
    ({"aggregations": [{"kind": "stats", "inputs": ["humidity"], "stats": ["mean"]}]}, "undeclared inputs"),
    ({"aggregations": [{"kind": "band_energy", "inputs": ["vibration"]}]}, "cut_hz"),
    ({"aggregations": [{"kind": "missing_rate", "inputs": ["rpm"]}, {"kind": "missing_rate", "inputs": ["rpm"]}]}, "unique"),
    ({"colour": "blue"}, "Extra inputs"),
])
def test_inconsistent_declarations_are_refused(tmp_path, changes, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(**changes)))
    with pytest.raises(TopologyError, match=message):
        load_feature_set(path)


def test_hopping_windows_list_every_start_holding_a_time():
    w = WindowSpec(size_ms=5000, hop_ms=1000, allowed_lateness_ms=0)
    assert w.starts(12_345) == [8000, 9000, 10_000, 11_000, 12_000]
    assert WindowSpec(size_ms=5000, hop_ms=5000).starts(12_345) == [10_000]
