"""Stream enrichment without a broker: the versioned entity table and the declared join, filter and fill.

The table is what ``TableFollower`` fills from the compacted topic (tests/integration/test_enrichment.py
runs that against Kafka); here versions are put by hand, as the follower puts them.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import yaml
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from pydantic import ValidationError

from prometheus_client import REGISTRY
from reference import PM
from streams.features import faust_job
from streams.features.batch import BatchWindows
from streams.features.compute import PartitionWindows, output_row
from streams.features.enrich import Join
from streams.features.spec import FeatureSet
from streams.errors import StackError
from streams.features.table import TableFollower, VersionedTable
from streams.topology import Topology

ENRICHMENT = {
    "table": "pm.devices",
    "schema": "pm.devices-value",
    "keep": {"status": ["online"]},
    "fill": {"temperature": "rated_temperature", "rpm": "rated_rpm"},
    "attributes": [{"name": "site", "one_hot": ["plant-a", "plant-b"]}, {"name": "rated_rpm", "range": [0, 10000]}],
}
FIELDS = ("status", "rated_temperature", "rated_rpm", "site")


def feature_set(**enrichment) -> FeatureSet:
    doc = yaml.safe_load((PM / "features" / "device_window.yaml").read_text())
    doc["enrichment"] = {**ENRICHMENT, **enrichment}
    return FeatureSet.model_validate(doc)


def device(status="online", temperature=60.0, rpm=1500.0, site="plant-a") -> dict:
    return {"status": status, "rated_temperature": temperature, "rated_rpm": rpm, "site": site, "model": "P-200"}


def readings(fs: FeatureSet, rows: list[tuple[str, int, float | None]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(entities, event times, values) of readings whose temperature is given (None: null) and rpm null."""
    values = np.full((len(rows), len(fs.inputs)), 1.0)
    values[:, fs.inputs.index("rpm")] = np.nan
    for i, (_, _, temperature) in enumerate(rows):
        values[i, fs.inputs.index("temperature")] = np.nan if temperature is None else temperature
    return [e for e, _, _ in rows], np.array([t for _, t, _ in rows], dtype=np.int64), values


def filtered(value: str) -> float:
    return REGISTRY.get_sample_value("tangram_features_filtered_total",
                                     {"processor": "features", "attribute": "status", "value": value}) or 0.0


def test_a_lookup_finds_the_version_in_effect_at_the_event_time():
    table = VersionedTable(("site",))
    table.put("d1", 1_000, {"site": "a"})
    table.put("d1", 5_000, {"site": "b"})
    table.put("d1", 9_000, None)  # a tombstone
    assert table.at("d1", 999) is None  # before its first version: unknown then
    assert [table.at("d1", t) for t in (1_000, 4_999, 5_000, 8_999)] == [("a",), ("a",), ("b",), ("b",)]
    assert table.at("d1", 9_000) is None and table.at("d2", 5_000) is None
    table.put("d1", 5_000, {"site": "c"})  # the same instant again: the newer write wins
    assert table.at("d1", 6_000) == ("c",)
    table.put("d1", 3_000, {"site": "x"})  # a version written out of order lands in its place
    assert table.at("d1", 3_500) == ("x",) and table.at("d1", 5_500) == ("c",)
    assert len(table) == 0  # d1's newest version is its tombstone


def test_the_table_keeps_a_bounded_number_of_versions_per_entity():
    table = VersionedTable(("site",), keep_versions=2)
    for i in range(5):
        table.put("d1", 1_000 * i, {"site": str(i)})
    assert table.at("d1", 4_000) == ("4",) and table.at("d1", 3_000) == ("3",)
    assert table.at("d1", 1_500) is None  # older than the versions kept


def test_readings_are_filtered_with_a_count_filled_from_the_table_and_unknown_ones_set_aside():
    fs = feature_set()
    table = VersionedTable(fs.enrichment.used)
    assert set(table.fields) == set(FIELDS)
    table.put("d-on", 0, device())
    table.put("d-off", 0, device(status="maintenance"))
    table.put("d-late", 0, device())
    table.put("d-late", 2_000, device(status="retired"))  # a table update between two of its readings
    join = Join(fs, table, "features")
    before = filtered("maintenance"), filtered("retired")
    entities, ts, values = readings(fs, [("d-on", 1_000, None), ("d-off", 1_000, 50.0), ("d-late", 1_500, 51.0),
                                         ("d-late", 2_500, 52.0), ("d-new", 1_000, 53.0), ("d-on", 1_100, 54.0)])
    verdicts = join.readings(entities, ts, values)
    assert verdicts.keep.tolist() == [True, False, True, False, False, True]
    assert verdicts.unknown.tolist() == [False] * 4 + [True, False]  # no version of d-new: a dead letter
    assert verdicts.failed == {1: ("status", "maintenance"), 3: ("status", "retired")}
    join.count(verdicts, late=np.array([False, False, False, True, False, False]))  # a late one: dead-lettered as late
    assert (filtered("maintenance") - before[0], filtered("retired") - before[1]) == (1, 0)
    t, rpm = fs.inputs.index("temperature"), fs.inputs.index("rpm")
    assert values[0, t] == 60.0 and values[5, t] == 54.0  # a null takes the rated value, a reading keeps its own
    assert values[0, rpm] == values[2, rpm] == 1500.0


def test_missing_defaults_join_an_unknown_entity_instead_of_dead_lettering_it():
    defaults = {"status": "online", "rated_temperature": 55.0, "rated_rpm": 1400.0, "site": "plant-b"}
    fs = feature_set(missing="defaults", defaults=defaults)
    join = Join(fs, VersionedTable(fs.enrichment.used), "features")
    entities, ts, values = readings(fs, [("d-new", 1_000, None)])
    verdicts = join.readings(entities, ts, values)
    assert verdicts.keep.tolist() == [True] and not verdicts.unknown.any()
    assert values[0, fs.inputs.index("temperature")] == 55.0
    assert join.attributes([("d-new", 0)]).tolist() == [[0.0, 1.0, 1400.0]]
    with pytest.raises(ValidationError, match="default for every attribute"):
        feature_set(missing="defaults", defaults={"status": "online"})


def test_window_attributes_are_encoded_in_declared_order_as_of_the_windows_last_instant():
    fs = feature_set()
    assert fs.attribute_names == ("site_plant_a", "site_plant_b", "rated_rpm")
    assert fs.feature_names[-3:] == fs.attribute_names and fs.feature_names[:-3] == fs.aggregate_names
    assert fs.feature_ranges()["site_plant_b"] == (0.0, 1.0) and fs.feature_ranges()["rated_rpm"] == (0, 10000)
    table = VersionedTable(fs.enrichment.used)
    table.put("d1", 0, device(site="plant-a", rpm=1500.0))
    table.put("d1", 4_999, device(site="plant-b", rpm=1600.0))  # the window [0, 5000)'s last instant
    table.put("d2", 0, device(site="plant-z"))                   # a site outside the one-hot: all zeros
    got = Join(fs, table, "features").attributes([("d1", 0), ("d1", 5_000), ("d2", 0), ("d3", 0)])
    assert got[:3].tolist() == [[0.0, 1.0, 1600.0], [0.0, 1.0, 1600.0], [0.0, 0.0, 1500.0]]
    assert got[3, :2].tolist() == [0.0, 0.0] and np.isnan(got[3, 2])  # no version, no defaults


def test_the_declarations_encoder_gives_a_training_script_what_the_join_appends():
    """``EnrichmentSpec.encode`` on a table value (a register entry) is what the engines append for it; on ``None``
    the defaults (or, without them, zeros and NaN), as for an entity with no version in effect."""
    table = VersionedTable(feature_set().enrichment.used)
    table.put("d1", 0, device(site="plant-b", rpm=1600.0))
    for fs in (feature_set(), feature_set(missing="defaults", defaults={"status": "online", "rated_temperature": 55.0,
                                                                       "rated_rpm": 1400.0, "site": "plant-a"})):
        joined = Join(fs, table, "features").attributes([("d1", 0), ("unknown", 0)])
        assert fs.enrichment.encode(device(site="plant-b", rpm=1600.0)) == joined[0].tolist() == [0.0, 1.0, 1600.0]
        np.testing.assert_array_equal(fs.enrichment.encode(None), joined[1])
    assert feature_set(missing="defaults", defaults={"status": "online", "rated_temperature": 55.0, "rated_rpm": 1400.0,
                                                     "site": "plant-a"}).enrichment.encode(None) == [1.0, 0.0, 1400.0]


def test_a_declaration_that_cannot_join_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match="not declared inputs"):
        feature_set(fill={"humidity": "rated_temperature"})
    doc = yaml.safe_load((PM / "topology.yaml").read_text())
    doc["root"] = str(PM)
    doc["processors"]["features"]["tables"] = ["pm.features.device_window"]
    with pytest.raises(ValidationError, match="must be a compacted topic"):
        Topology.model_validate(doc)


def test_a_reading_left_out_of_the_stream_still_moves_its_partitions_time_and_joins_no_window():
    """As in the Flink job, lateness is the partition's, decided before the join: an offline device's
    reading closes the windows its time passes, and a late one is late whatever its entity."""
    fs = feature_set()
    windows = BatchWindows(fs, offset=lambda offset: offset)
    windows.start(0, closed_through=-1)
    row = [1.0] * len(fs.inputs)

    def add(entities, ts, excluded):
        return windows.add(windows.ids(entities), np.zeros(len(ts), dtype=np.int64), np.array(ts),
                           np.array([row] * len(ts)), list(range(len(ts))), excluded=np.array(excluded))

    first = add(["on", "off"], [1_000, 1_200], [False, True])
    assert first.closed == [] and not first.late.any()
    moved = add(["off"], [6_000], [True])  # only the excluded device speaks: its time closes on's window
    assert [(c.entity, c.start) for c in moved.closed] == [("on", 0)]
    counts, _ = windows.features(moved.closed)
    assert counts.tolist() == [1]  # off's reading at 1.2 s never joined a window
    late = add(["off", "on"], [4_000, 4_500], [True, False])
    assert late.late.tolist() == [True, True]


def test_the_per_reading_state_judges_lateness_before_the_join_as_the_batch_does():
    """The Faust job's order over the per-reading state: ``late`` first (it changes nothing), then a reading the
    join leaves out (filtered, unknown) or a late one only moves the clock: the batch test's decisions above."""
    fs = feature_set()
    state = PartitionWindows(fs)
    row = [1.0] * len(fs.inputs)

    def feed(entity: str, ts: int, excluded: bool) -> tuple[bool, list[dict]]:
        before = (state.stream_time, state.closed_through, len(state.open))
        late = state.late(ts)
        assert (state.stream_time, state.closed_through, len(state.open)) == before
        if late or excluded:
            return late, state.advance(ts)
        accepted, closed = state.add(entity, ts, row)
        assert accepted
        return late, closed

    assert feed("on", 1_000, False) == feed("off", 1_200, True) == (False, [])
    late, closed = feed("off", 6_000, True)  # only the excluded device speaks: its time closes on's window
    assert not late and [(c["entity"], c["start"], c["count"]) for c in closed] == [("on", 0, 1)]
    assert [feed("off", 4_000, True)[0], feed("on", 4_500, False)[0]] == [True, True]


def test_a_windows_row_has_its_table_attributes_after_its_aggregates():
    fs = feature_set()
    state = PartitionWindows(fs)
    state.add("d1", 1_000, [1.0] * len(fs.inputs))
    [closed] = state.close_all()
    row = output_row(fs, "d1", closed, np.array([0.0, 1.0, 1600.0]))
    assert tuple(row) == fs.columns and [row[n] for n in fs.attribute_names] == [0.0, 1.0, 1600.0]
    with pytest.raises(ValueError):  # a joining feature set's row without its attributes is refused
        output_row(fs, "d1", closed)


def test_the_faust_job_takes_the_table_topic_read():
    argv = faust_job.command("python", bootstrap="b", registry="r", redis_url="u", project="p", source="s",
                             output="o", dlq="d", group="g", feature_set="f.yaml", table="ns.devices")
    assert faust_job.parse_args(argv[3:]).table == "ns.devices"
    assert faust_job.parse_args(argv[3:-2]).table is None  # the feature set's `enrichment.table`


def test_the_live_entity_count_follows_versions_and_tombstones():
    table = VersionedTable(("site",))
    table.put("a", 1_000, {"site": "x"})
    table.put("b", 1_000, {"site": "y"})
    table.put("a", 2_000, None)
    table.put("a", 500, {"site": "w"})  # an older version of a: its newest is still the tombstone
    assert len(table) == 1
    table.put("a", 3_000, {"site": "z"})
    table.put("b", 1_000, None)  # the same instant rewritten as a tombstone
    assert len(table) == 1 and table.at("b", 1_500) is None


class _NoLeaderYet:
    """A consumer whose broker has no leader for the table's partition for the first ``fails`` asks."""

    def __init__(self, fails: int):
        self.fails = fails

    def get_watermark_offsets(self, partition, timeout):
        if self.fails:
            self.fails -= 1
            raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
        return 0, 7


def test_the_restore_asks_again_while_a_just_created_table_has_no_leader():
    follower = TableFollower.__new__(TableFollower)
    follower.topic, follower.consumer = "pm.devices", _NoLeaderYet(3)
    assert follower._end(TopicPartition("pm.devices", 0), time.monotonic() + 5) == 7
    follower.consumer = _NoLeaderYet(10**6)
    with pytest.raises(StackError, match="partition 0 is not known: .*[Nn]ot leader"):
        follower._end(TopicPartition("pm.devices", 0), time.monotonic() + 0.5)
