"""`tangram dlq inspect` and `tangram dlq replay` on the real broker: after a fix, the records come back."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from streams.cli import app
from streams.run import make_runner
from streams.topology import load_topology

from gateway_helpers import headers, ingest_topology, read_topic

pytestmark = pytest.mark.integration


def reading(i: int, **over) -> dict:
    return {"event_id": f"dev-d-{i}-{uuid.uuid4().hex[:6]}", "device_id": "dev-d", "ts": int(time.time() * 1000),
            "temperature": 60.0, "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0, **over}


def run_ingest(topology, stack, until) -> None:
    runner = make_runner(topology, "ingest", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    try:
        while not until() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        runner.stop()
        thread.join(30)


def test_inspect_then_replay_after_the_fix(stack, tmp_path):
    # the contract first allows vibration up to 100: 3 readings at 150 are refused
    topology, prefix = ingest_topology(tmp_path, stack)
    raw, out, dlq = f"{prefix}.raw.telemetry", f"{prefix}.ingest.telemetry", f"{prefix}.dlq.ingest"
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True})
    for i in range(5):
        producer.produce(raw, json.dumps(reading(i, vibration=150.0 if i % 2 == 0 else 2.0)).encode(), "dev-d")
    producer.produce(raw, b"not json", "dev-d")
    assert producer.flush(10) == 0
    run_ingest(topology, stack, lambda: len(read_topic(stack, dlq, idle_s=0.1)) >= 4)
    assert len(read_topic(stack, out)) == 2

    cli = CliRunner()
    inspected = cli.invoke(app, ["dlq", "inspect", dlq], env={"COLUMNS": "300"})
    assert inspected.exit_code == 0, inspected.output
    assert "4 record(s)" in inspected.output and "out_of_range: 3" in inspected.output and "bad_json: 1" in inspected.output
    assert f"{raw}[0]@" in inspected.output  # the source of each

    # the fix: the range is widened; replay only the out_of_range ones to the ingest input
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text((tmp_path / f"{prefix}.yaml").read_text().replace("- 100.0", "- 200.0"))
    assert load_topology(fixed).processors["ingest"].params["ranges"]["vibration"] == [0.0, 200.0]
    dry = cli.invoke(app, ["dlq", "replay", dlq, "--to", raw, "--reason", "out_of_range", "--dry-run"])
    assert dry.exit_code == 0 and "would replay 3" in dry.output
    replayed = cli.invoke(app, ["dlq", "replay", dlq, "--to", raw, "--reason", "out_of_range"])
    assert replayed.exit_code == 0 and "replayed 3" in replayed.output, replayed.output
    run_ingest(load_topology(fixed), stack, lambda: len(read_topic(stack, out, idle_s=0.1)) >= 5)

    ingested = read_topic(stack, out)
    assert len(ingested) == 5 and len({headers(m)["event_id"] for m in ingested}) == 5
    back = [m for m in read_topic(stack, raw) if "dlq.replayed_from" in headers(m)]
    assert len(back) == 3 and all(not k.startswith("dlq.") or k == "dlq.replayed_from" for m in back for k in headers(m))
    assert all(headers(m)["dlq.replayed_from"].startswith(f"{dlq}[0]@") for m in back)
    # the DLQ tools read with assign() and never commit: no consumer group of theirs exists
    groups = AdminClient({"bootstrap.servers": stack.bootstrap_servers}).list_consumer_groups().result(timeout=10)
    assert not [g.group_id for g in groups.valid if g.group_id.startswith("tangram-dlq-reader")]


def test_inspect_names_a_missing_topic(stack):
    result = CliRunner().invoke(app, ["dlq", "inspect", f"nope{uuid.uuid4().hex[:6]}.dlq.ingest"])
    assert result.exit_code != 0 and "does not exist" in str(result.exception)
