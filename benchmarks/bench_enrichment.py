"""What joining the entity table costs the features stage, and what the table costs in memory (figures, not tests).

Needs a running stack (`tangram up`, or TANGRAM_* variables pointing at one).

    .venv/bin/python benchmarks/bench_enrichment.py [--devices 200] [--seconds 250] [--entities 100000]

Prints:
- the embedded engine (the ``features`` processor in its delivery loop, writing Feast's store) over the same
  N readings (default 200 devices × 250 s at 10 Hz = 500,000) three times in this run: without the join (the
  reference feature set, its own join taken out: the window aggregates alone), with it, and without it again — a table of ENTITIES devices (the recorded ones and others, every
  one online), ``keep: status online``, a null temperature filled from the rated value, the site one-hot
  and the rated rpm appended to every window — each in readings/s from its first batch, windows counted
  on every side, and the ratio to the mean of the two runs without (goal ≥ 0.9: the join costs at most 10 %);
- the RSS growth of a process of its own restoring the ENTITIES-device table from its topic with the
  processor's own code (``TableFollower``), per 100k entities.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml
from confluent_kafka import Producer

from streams.avro import codec
from streams.namespace import DELETE, namespaced
from streams.plan import apply
from streams.settings import StackSettings
from streams.testing import produce_records
from streams.topology import Topology, load_topology

from bench_features import _rss_kib, embedded
from reference_app import APP, FEATURE_SET, SCHEMAS, TOPOLOGY, load_schema, recorded_readings
from report import Figure, emit, scratch

ATTRIBUTES = ("site_plant_a", "site_plant_b", "rated_rpm")


def schemas(tmp: Path) -> Path:
    """The reference contracts, plus this benchmark's two outputs: the window aggregates alone (``plain``) and
    the aggregates with this benchmark's attributes (``enriched``), in place of the reference's rated values."""
    folder = tmp / "schemas"
    shutil.copytree(SCHEMAS, folder, dirs_exist_ok=True)
    contract = load_schema("pm.features.device_window-value")
    contract["fields"] = [f for f in contract["fields"] if f["name"] not in FEATURE_SET.attribute_names]
    (folder / "pm.features.device_window_plain-value.avsc").write_text(
        json.dumps({**contract, "name": "DeviceWindowPlain"}))
    (folder / "pm.features.device_window_enriched-value.avsc").write_text(json.dumps(
        {**contract, "name": "DeviceWindowEnriched",
         "fields": contract["fields"] + [{"name": n, "type": "double"} for n in ATTRIBUTES]}))
    return folder


def enriched(tmp: Path, prefix: str, table: str) -> Topology:
    """The reference topology under ``prefix`` whose features processor joins ``table`` (its own output topic
    and contract: the window aggregates and this benchmark's attributes)."""
    subject = "pm.features.device_window_enriched-value"
    fs = yaml.safe_load((APP / "features" / "device_window.yaml").read_text())
    fs["output"]["schema"] = subject
    fs["enrichment"] = {"table": table, "schema": "pm.devices-value", "keep": {"status": ["online"]},
                        "fill": {"temperature": "rated_temperature"},
                        "attributes": [{"name": "site", "one_hot": ["plant-a", "plant-b"]}, {"name": "rated_rpm"}]}
    (tmp / "enriched.yaml").write_text(yaml.safe_dump(fs, sort_keys=False))
    doc = yaml.safe_load(namespaced(TOPOLOGY, prefix, tmp / f"{prefix}.yaml").read_text())
    doc["schemas"] = str(schemas(tmp))
    doc["topics"][table] = {"schema": "pm.devices-value", "cleanup_policy": "compact"}
    doc["topics"][f"{prefix}.features.device_window"]["schema"] = subject
    doc["processors"]["features"].update(tables=[table])
    doc["processors"]["features"]["params"]["feature_set"] = str(tmp / "enriched.yaml")
    return Topology.model_validate(doc)


def plain(tmp: Path, prefix: str) -> Topology:
    """The reference topology under ``prefix`` with its feature set's join taken out (no table, no `enrichment:`):
    the window aggregates alone, to its own contract."""
    subject = "pm.features.device_window_plain-value"
    fs = yaml.safe_load((APP / "features" / "device_window.yaml").read_text())
    fs.pop("enrichment", None)
    fs["output"]["schema"] = subject
    (tmp / "plain.yaml").write_text(yaml.safe_dump(fs, sort_keys=False))
    doc = yaml.safe_load(namespaced(TOPOLOGY, prefix, tmp / f"{prefix}.yaml", {
        "processors/features/tables": DELETE, "processors/features/params/feature_set": str(tmp / "plain.yaml")}
    ).read_text())
    doc["schemas"] = str(schemas(tmp))
    doc["topics"][f"{prefix}.features.device_window"]["schema"] = subject
    return Topology.model_validate(doc)


def fill_table(stack: StackSettings, table: str, devices: list[str], entities: int, at_ms: int) -> None:
    """``entities`` devices in ``table`` (``devices`` first, then others), every one online, effective ``at_ms``."""
    out = Producer(stack.kafka.config({"linger.ms": 20, "compression.type": "lz4"}))
    device_codec = codec(stack.registry_url, "pm.devices-value", load_schema("pm.devices-value"))
    names = devices + [f"other-{i:06d}" for i in range(entities - len(devices))]
    failed: list = []
    for i, name in enumerate(names):
        value = {"device_id": name, "model": "P-200", "site": ("plant-a", "plant-b")[i % 2], "install_date": 19000,
                 "status": "online", "rated_rpm": 1450.0 + i % 100, "rated_temperature": 61.5, "rated_current": 12.0}
        while True:
            try:
                out.produce(table, device_codec.encode(value), name, timestamp=at_ms,
                            on_delivery=lambda err, _: err and failed.append(err))
                break
            except BufferError:
                out.poll(0.05)
    if out.flush(120) or failed:
        raise SystemExit(f"the table {table} was not written: {failed[:3]}")


def table_memory(stack: StackSettings, tmp: Path, table: str, entities: int) -> float:
    """MiB per 100k entities: the RSS growth of a process of its own restoring the table (``enriched``'s files)."""
    child = subprocess.Popen([sys.executable, __file__, "--restore-child", str(tmp / "enriched.yaml"), table,
                              str(tmp / "schemas")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
    assert child.stdout is not None and child.stdin is not None
    child.stdout.readline()  # "ready": imports done, nothing read yet
    before, _ = _rss_kib(child.pid)
    child.stdin.write("go\n")
    child.stdin.flush()
    restored = int(child.stdout.readline())
    after, peak = _rss_kib(child.pid)
    child.stdin.close()
    child.wait(30)
    if restored < entities:
        raise SystemExit(f"the table restored {restored} entities, not {entities}")
    per_100k = (after - before) / 1024 * 100_000 / entities
    print(f"  table memory (a process restoring it with TableFollower): RSS {before / 1024:.1f} → {after / 1024:.1f} MiB "
          f"(peak {peak / 1024:.1f}) for {restored:,} entities: {per_100k:.1f} MiB per 100k entities")
    return per_100k


def restore_child(feature_set: str, table: str, schemas: str) -> None:
    """(the child of :func:`table_memory`) Restore ``table`` once told to; print the entities it holds."""
    from streams.features.spec import load_feature_set
    from streams.features.table import TableFollower, VersionedTable

    stack = StackSettings()
    fs = load_feature_set(feature_set)
    subject = "pm.devices-value"
    table_codec = codec(stack.registry_url, subject, json.loads((Path(schemas) / f"{subject}.avsc").read_text()))
    state = VersionedTable(fs.enrichment.used)
    follower = TableFollower(stack.kafka.config({"group.id": f"bench-restore-{uuid.uuid4().hex[:6]}"}), table,
                             table_codec.decode, state)
    print("ready", flush=True)
    sys.stdin.readline()
    follower.restore()
    print(len(state), flush=True)
    sys.stdin.readline()
    follower.close()


def measure(args: argparse.Namespace, stack: StackSettings, tmp: Path) -> None:
    """Memory only (``--memory-only``), or the engine without, with and again without the join, then memory."""
    if args.memory_only:
        prefix = f"b{uuid.uuid4().hex[:8]}"
        table = f"{prefix}.devices"
        apply(enriched(tmp, prefix, table), stack, models=False)
        fill_table(stack, table, [], args.entities, at_ms=int(time.time() * 1000) - 60_000)
        table_memory(stack, tmp, table, args.entities)
        return
    readings = recorded_readings(args.devices, args.seconds, late_every=10**9, straggle_every=10**9)
    windows = args.devices * (int(args.seconds * 1000) // FEATURE_SET.window.size_ms - 1)
    n = len(readings)
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))

    plain_prefix = f"b{uuid.uuid4().hex[:8]}"
    without = plain(tmp, plain_prefix)
    prefix = f"b{uuid.uuid4().hex[:8]}"
    table = f"{prefix}.devices"
    joined = enriched(tmp, prefix, table)
    batch = joined.processors["features"].batch_size
    for topology, name in ((without, plain_prefix), (joined, prefix)):
        apply(topology, stack, models=False)
        produce_records(stack.kafka, f"{name}.ingest.telemetry", in_codec, readings, key="device_id")
    started = time.perf_counter()
    fill_table(stack, table, sorted({r["device_id"] for r in readings}), args.entities,
               at_ms=min(r["ts"] for r in readings) - 60_000)
    print(f"input: {n:,} readings of {args.devices} devices over {args.seconds:.0f} s of event time → {windows:,} "
          f"windows; batch size {batch}; table of {args.entities:,} devices written in "
          f"{time.perf_counter() - started:.1f} s")

    # without, with, without again (its own topics and group: it reads the readings from the start again): the
    # ratio is to the mean of the two runs without, as the raw loop's is in bench_features
    before, before_windows = embedded(without, stack, n)
    on, on_windows = embedded(joined, stack, n)  # its clock starts at its first batch: the restore is before it
    again_prefix = f"b{uuid.uuid4().hex[:8]}"
    again_topology = plain(tmp, again_prefix)
    apply(again_topology, stack, models=False)
    produce_records(stack.kafka, f"{again_prefix}.ingest.telemetry", in_codec, readings, key="device_id")
    after, after_windows = embedded(again_topology, stack, n)
    for label, run, got in (("without the join", before, before_windows), ("with the join", on, on_windows),
                            ("without, again", after, after_windows)):
        print(f"  embedded engine {label:<18} {run.rate:>10,.0f} readings/s   {run.cpu_us:5.2f} µs CPU/reading   "
              f"({got:,} windows out)")
        if got != windows:
            raise SystemExit(f"the embedded engine {label} emitted {got:,} windows, not {windows:,}")
    off = (before.rate + after.rate) / 2
    ratio = on.rate / off
    print(f"  join on / off: {ratio:.3f}× (goal ≥ 0.9; off is the mean of the runs before and after)")
    emit(Figure(f"feature windows with the entity-table join ({args.entities:,} entities; keep, fill, 3 attributes)",
                f"{on.rate:,.0f} readings/s, {on.cpu_us:.1f} µs CPU/reading ({on_windows:,} windows out)",
                f"the same engine without the join, {off:,.0f}/s (mean of {before.rate:,.0f} before and "
                f"{after.rate:,.0f} after; {windows:,} windows out each)",
                f"{ratio:.3f} (goal ≥ 0.9)", n=n, batch=batch, benchmark="bench_enrichment", value=on.rate))
    per_100k = table_memory(stack, tmp, table, args.entities)
    emit(Figure("entity table memory per 100k entities (process RSS growth restoring it)", f"{per_100k:.1f} MiB",
                "-", "-", n=args.entities, batch="-", benchmark="bench_enrichment"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=200)
    p.add_argument("--seconds", type=float, default=250.0, help="Event time of the recording (10 readings/s/device).")
    p.add_argument("--entities", type=int, default=100_000, help="Devices in the table (the recorded ones included).")
    p.add_argument("--memory-only", action="store_true", help="Only the table's memory (a table of ENTITIES written).")
    p.add_argument("--restore-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.restore_child:
        restore_child(*args.restore_child)
        return
    with scratch("bench-enrichment-") as tmp:
        measure(args, StackSettings(), tmp)


if __name__ == "__main__":
    main()
