"""Stream enrichment on the real stack: the features processor restores its entity table from a compacted
topic, follows it live, and joins, filters and fills readings and windows as the feature set declares; the
Flink job's event-time temporal join and the Faust job over the same table give the same rows and dead letters."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
import yaml
from confluent_kafka import Producer
from prometheus_client import REGISTRY

from reference import REPO, load_schema
from streams.avro import codec
from streams.context import BuildContext
from streams.delivery import Record
from streams.flink.launcher import job_argv, run_job
from streams.plan import apply
from streams.run import make_runner
from streams.features.spec import load_feature_set
from streams.testing import by_window, create_topics, diff_rows, expected_windows, produce_records, read_rows
from pm_app.simulator import BASE_MS, SENSORS, Device, recorded_readings
from streams.topology import Topology

from isolation import isolated_topology
from test_parity import run_faust_job

pytestmark = pytest.mark.integration

#: a window boundary (5 s windows) ten minutes ago: the broker refuses record timestamps far in the future
T0 = (int(time.time() * 1000) - 600_000) // 5_000 * 5_000
ENRICHED = "pm.features.device_window_enriched-value"


def enriched_topology(tmp_path, prefix_path, idle_partition_s: float | None = None) -> tuple[Topology, str, str]:
    """The reference topology with a device table its features processor joins (a feature set declaring
    keep, fill and attributes of its own in place of the reference's, and an output contract with the window
    aggregates and those attributes' columns)."""
    path, prefix = prefix_path
    schemas = tmp_path / "schemas"
    shutil.copytree(REPO / "schemas" / "avro", schemas)
    output = load_schema("pm.features.device_window-value")
    output["name"] = "DeviceWindowEnriched"
    reference = load_feature_set(REPO / "topologies" / "predictive_maintenance" / "features" / "device_window.yaml")
    output["fields"] = [f for f in output["fields"] if f["name"] not in reference.attribute_names]  # the aggregates
    output["fields"] += [{"name": n, "type": "double"} for n in ("site_plant_a", "site_plant_b", "rated_rpm")]
    (schemas / f"{ENRICHED}.avsc").write_text(json.dumps(output))
    fs = yaml.safe_load((REPO / "topologies" / "predictive_maintenance" / "features" / "device_window.yaml").read_text())
    table = f"{prefix}.devices"
    fs["output"]["schema"] = ENRICHED
    # the table by the reference app's name, as the source and output: the processor's own (`tables:`) is joined
    fs["enrichment"] = {"table": "pm.devices", "schema": "pm.devices-value", "keep": {"status": ["online"]},
                        "fill": {"temperature": "rated_temperature"},
                        "attributes": [{"name": "site", "one_hot": ["plant-a", "plant-b"]}, {"name": "rated_rpm"}]}
    (tmp_path / "enriched.yaml").write_text(yaml.safe_dump(fs, sort_keys=False))
    doc = yaml.safe_load(path.read_text())
    doc["schemas"] = str(schemas)
    doc["topics"][table] = {"schema": "pm.devices-value", "cleanup_policy": "compact"}
    doc["topics"][f"{prefix}.features.device_window"]["schema"] = ENRICHED
    features = doc["processors"]["features"]
    features["tables"] = [table]
    features["params"]["feature_set"] = str(tmp_path / "enriched.yaml")
    if idle_partition_s is not None:
        features["params"]["idle_partition_s"] = idle_partition_s
    return Topology.model_validate(doc), prefix, table


def put_versions(stack, table: str, versions: list[tuple[str, dict | None, int]]) -> None:
    """Write (key, value or None for a tombstone, effective ms) to the table topic, each acknowledged."""
    devices = codec(stack.registry_url, "pm.devices-value", load_schema("pm.devices-value"))
    producer, failed = Producer(stack.kafka.config()), []
    for key, value, at in versions:
        producer.produce(table, None if value is None else devices.encode(value), key, timestamp=at,
                         on_delivery=lambda err, _: err and failed.append(err))
    assert producer.flush(30) == 0 and not failed, failed


def device(device_id: str, status: str = "online", site: str = "plant-a", rpm: float = 1500.0) -> dict:
    return {"device_id": device_id, "model": "P-200", "site": site, "install_date": 19000, "status": status,
            "rated_rpm": rpm, "rated_temperature": 61.5, "rated_current": 12.0}


def filtered(value: str) -> float:
    return REGISTRY.get_sample_value("tangram_features_filtered_total",
                                     {"processor": "features", "attribute": "status", "value": value}) or 0.0


def test_the_features_processor_joins_its_entity_table_restored_and_followed_live(stack, tmp_path):
    topology, prefix, table = enriched_topology(tmp_path, isolated_topology(tmp_path))
    apply(topology, stack, models=False)
    devices = codec(stack.registry_url, "pm.devices-value", load_schema("pm.devices-value"))
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, **stack.kafka.config()})

    failed: list = []

    def put(key: str, value: dict | None, at: int) -> None:
        producer.produce(table, None if value is None else devices.encode(value), key, timestamp=at,
                         on_delivery=lambda err, _: err and failed.append(err))

    put("d-on", device("d-on"), T0 - 60_000)
    put("d-off", device("d-off", status="maintenance"), T0 - 60_000)
    put("d-moved", device("d-moved", site="plant-a", rpm=1500.0), T0 - 60_000)
    put("d-gone", device("d-gone"), T0 - 60_000)
    put("d-gone", None, T0 + 3_000)  # a tombstone: from then on, d-gone is unknown
    assert producer.flush(30) == 0 and not failed, failed

    processor = topology.load_object(topology.processors["features"].kind).build(BuildContext(topology, "features", stack))
    processor.name = "features"
    processor.setup()  # the table restored before the first reading
    try:
        table_state = processor.join.table
        assert table_state.at("d-on", T0) is not None and table_state.at("d-gone", T0 + 3_000) is None
        # followed live: a site change written now, in effect between two of d-moved's readings
        put("d-moved", device("d-moved", site="plant-b", rpm=1600.0), T0 + 2_000)
        assert producer.flush(30) == 0 and not failed, failed
        deadline = time.monotonic() + 15
        while (table_state.at("d-moved", T0 + 2_000) or ())[table_state.fields.index("site"):] [:1] != ("plant-b",):
            assert time.monotonic() < deadline, f"the live update never reached the table: {table_state._versions}"
            time.sleep(0.1)

        telemetry = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
        rng = np.random.default_rng(5)
        records, offset, first_window = [], 0, []
        for k in range(130):  # 13 s at 10 Hz: the windows [T0, T0+5s) and [T0+5s, T0+10s) close
            for name in ("d-on", "d-off", "d-moved", "d-gone", "d-unknown"):
                values = Device.random(name, rng).sample(np.array([k / 10]), rng)[0]
                reading = {"event_id": f"{name}-{k}", "device_id": name, "ts": T0 + 100 * k,
                           **{s: float(v) for s, v in zip(SENSORS, values)}}
                if name == "d-on" and k % 2:
                    reading["temperature"] = None  # every other reading of d-on: filled with its rated value
                if name == "d-on" and k < 50:
                    first_window.append(61.5 if reading["temperature"] is None else reading["temperature"])
                records.append(Record(f"{prefix}.ingest.telemetry", 0, offset, name.encode(),
                                      telemetry.encode(reading), {"trace_id": b"0" * 32}, T0 + 100 * k))
                offset += 1
        before = filtered("maintenance")
        outputs = processor.process(records)
        processor.flush().result()  # the online write, done in the writer's thread

        dead = [o for o in outputs if o.topic == f"{prefix}.dlq.features"]
        reasons = {(o.key, dict(o.headers)["dlq.reason"]) for o in dead}
        assert reasons == {(b"d-unknown", "unknown_entity"), (b"d-gone", "unknown_entity")}
        assert sum(o.key == b"d-unknown" for o in dead) == 130
        assert sum(o.key == b"d-gone" for o in dead) == 100  # its readings from the tombstone on (T0 + 3 s)
        assert all(f"has no version in table {prefix}.devices at " in dict(o.headers)["dlq.error_message"]
                   for o in dead)  # the topic it read, not the feature set's default name
        assert filtered("maintenance") - before == 130  # d-off left the stream, counted, not dead-lettered

        window_codec = codec(stack.registry_url, ENRICHED, json.loads((tmp_path / "schemas" / f"{ENRICHED}.avsc").read_text()))
        rows = {(r["device_id"], r["window_start"]): r for r in
                (window_codec.decode(o.value) for o in outputs if o.topic == f"{prefix}.features.device_window")}
        assert set(rows) == {(d, T0 + s) for d in ("d-on", "d-moved") for s in (0, 5_000)} | {("d-gone", T0)}
        on = rows[("d-on", T0)]
        assert (on["site_plant_a"], on["site_plant_b"], on["rated_rpm"]) == (1.0, 0.0, 1500.0)
        assert on["missing_rate"] == 0.0  # the nulls were filled before the window saw them
        assert on["temperature_mean"] == pytest.approx(np.mean(first_window), rel=1e-12)
        moved = rows[("d-moved", T0)]  # the version in effect at the window's last instant: plant-b since T0+2 s
        assert (moved["site_plant_a"], moved["site_plant_b"], moved["rated_rpm"]) == (0.0, 1.0, 1600.0)
        assert rows[("d-gone", T0)]["count"] == 30  # its readings before the tombstone
    finally:
        processor.close()

    # a restart restores the same table, the live update and the tombstone included
    again = topology.load_object(topology.processors["features"].kind).build(BuildContext(topology, "features", stack))
    again.name = "features"
    again.setup()
    try:
        fields = again.join.table.fields
        assert again.join.table.at("d-moved", T0 + 4_999)[fields.index("site")] == "plant-b"
        assert again.join.table.at("d-moved", T0 + 1_999)[fields.index("site")] == "plant-a"
        assert again.join.table.at("d-gone", T0 + 3_000) is None and again.join.table.at("d-gone", T0) is not None
    finally:
        again.close()


def dead_letters(stack, topic: str) -> dict[tuple[bytes, bytes], bytes]:
    """The dead letters of ``topic``: (source partition, source offset) → reason."""
    return {(h["dlq.source_partition"], h["dlq.source_offset"]): h["dlq.reason"]
            for h in (dict(m.headers()) for m in read_rows(stack.kafka, topic, None, idle_s=2.0))}


@pytest.fixture(scope="module")
def recording(stack, tmp_path_factory):
    """One recording and one table, through the embedded engine: a site change between two readings of a
    device, a tombstone mid-stream, a device unknown for its first seconds, one out of service."""
    tmp_path = tmp_path_factory.mktemp("enrichment")
    topology, prefix, table = enriched_topology(tmp_path, isolated_topology(tmp_path), idle_partition_s=2)
    apply(topology, stack, models=False)
    readings = recorded_readings(8, 30.0)
    put_versions(stack, table, [
        *((f"dev-{i:05d}", device(f"dev-{i:05d}", site=("plant-b", "plant-a")[i % 2], rpm=1400.0 + i), BASE_MS - 60_000)
          for i in (0, 1, 2, 3, 4, 6)),
        ("dev-00005", device("dev-00005", status="maintenance"), BASE_MS - 60_000),  # filtered throughout
        ("dev-00001", device("dev-00001", site="plant-b", rpm=1600.0), BASE_MS + 12_345),  # moved mid-window
        ("dev-00002", None, BASE_MS + 17_000),  # retired: unknown from then on
        ("dev-00007", device("dev-00007"), BASE_MS + 9_000),  # registered 9 s into the stream
    ])
    source = f"{prefix}.ingest.telemetry"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    produce_records(stack.kafka, source, in_codec, readings, key="device_id", partitions=3)
    out_codec = codec(stack.registry_url, ENRICHED, json.loads((tmp_path / "schemas" / f"{ENRICHED}.avsc").read_text()))

    runner = make_runner(topology, "features", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        embedded = by_window(read_rows(stack.kafka, f"{prefix}.features.device_window", out_codec, idle_s=8.0),
                             key="device_id")
    finally:
        runner.stop()
        thread.join(30)
    return {"tmp": tmp_path, "prefix": prefix, "table": table, "source": source, "readings": readings,
            "out_codec": out_codec, "embedded": embedded, "dead": dead_letters(stack, f"{prefix}.dlq.features")}


def test_the_flink_temporal_join_gives_the_embedded_engines_rows_and_dead_letters(stack, recording):
    """Both engines over the same recording and the same table (the ``recording`` fixture's)."""
    prefix, tmp_path, embedded = recording["prefix"], recording["tmp"], recording["embedded"]
    output, dlq = f"{prefix}.features.flink", f"{prefix}.dlq.flink"
    create_topics(stack.kafka, [output, dlq])
    run_job(job_argv(stack, feature_set=str(tmp_path / "enriched.yaml"), dlq=dlq, group=f"{prefix}.flink",
                     source=recording["source"], output=output, table=recording["table"], bounded=True), timeout_s=400,
            log_path=tmp_path / "flink.log",
            settings=stack)
    flink = by_window(read_rows(stack.kafka, output, recording["out_codec"], idle_s=2.0), key="device_id")

    problems = diff_rows(embedded, flink, rel=1e-9)
    assert problems == [], "\n".join(problems)
    devices = {d for d, _ in embedded}
    assert "dev-00005" not in devices and {"dev-00002", "dev-00007"} <= devices
    assert max(s for d, s in embedded if d == "dev-00002") < BASE_MS + 20_000  # nothing after its tombstone
    assert min(s for d, s in embedded if d == "dev-00007") >= BASE_MS + 5_000  # nothing before it was known
    moved = {s: (r["site_plant_a"], r["site_plant_b"], r["rated_rpm"]) for (d, s), r in embedded.items() if d == "dev-00001"}
    assert moved[BASE_MS + 5_000] == (1.0, 0.0, 1401.0) and moved[BASE_MS + 10_000] == (0.0, 1.0, 1600.0)

    assert dead_letters(stack, dlq) == recording["dead"]
    assert set(recording["dead"].values()) == {b"late", b"unknown_entity"}


def test_the_faust_job_joins_the_table_as_the_embedded_engine_does(stack, recording):
    """The Faust job over the same recording and table (``--table``: the namespaced topic): the same rows, on the
    windows the stream's own time closed (it has no idle timeout), and the same dead letters with their reasons."""
    prefix, tmp_path, embedded = recording["prefix"], recording["tmp"], recording["embedded"]
    fs = load_feature_set(tmp_path / "enriched.yaml")
    closed_by_time = expected_windows(recording["readings"], fs, 3)[0].keys()  # the join changes no stream time
    closed = {key: row for key, row in embedded.items() if key in closed_by_time}
    assert ("dev-00001", BASE_MS + 10_000) in closed and any(d == "dev-00007" for d, _ in closed)
    output, dlq = f"{prefix}.features.faust", f"{prefix}.dlq.faust"
    create_topics(stack.kafka, [output, dlq])
    run_faust_job(stack, tmp_path / "faust.log", {output: len(closed), dlq: len(recording["dead"])},
                  project=f"{prefix}-faust", source=recording["source"], output=output, dlq=dlq,
                  group=f"{prefix}.features-faust", feature_set=str(tmp_path / "enriched.yaml"), table=recording["table"])
    faust = by_window(read_rows(stack.kafka, output, recording["out_codec"], idle_s=2.0), key="device_id")

    problems = diff_rows(closed, faust, rel=1e-9)
    assert problems == [], "\n".join(problems)
    faust_dead = dead_letters(stack, dlq)
    assert faust_dead == recording["dead"]
    unknown = [dict(m.headers())["dlq.error_message"] for m in read_rows(stack.kafka, dlq, None, idle_s=2.0)
               if dict(m.headers())["dlq.reason"] == b"unknown_entity"]
    assert unknown and all(f"has no version in table {recording['table']} at ".encode() in m for m in unknown)
