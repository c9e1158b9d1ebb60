"""Feast: the declared feature set registered with Feast, and the backfill of its Redis store from Kafka.

In the Feast environment (``.venv-feast``, a subprocess each): ``python -m streams.feast apply``
generates the feature repository against the test Redis and registers it (``feast feature-views
list`` run in the repository then lists the view); feature-window records produced to an
isolated features topic (Confluent-framed Avro, from this application environment) are pushed
into Feast's online store by ``python -m streams.feast sync``; ``python -m streams.feast get``
reads them back through ``FeatureStore.get_online_features`` and every value equals the newest
row produced for its device. A second ``sync`` of the same group finds nothing left: the offsets
were committed after the push. The bytes Feast's own writer put in Redis are the bytes
``streams.features.layout`` encodes for the same rows, and the application's lookup reads them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import uuid

import pytest
import redis
from confluent_kafka import Producer

from reference import REPO as PROJECT_ROOT
from streams.avro import codec
from streams.features.layout import FeastLayout
from streams.features.online import read_online_features
from reference import PM
from streams.features.spec import load_feature_set

DEFAULT_FEATURE_SET = PM / "features" / "device_window.yaml"
from streams.testing import create_topics
from reference import load_schema

pytestmark = pytest.mark.integration

FEAST_PYTHON = PROJECT_ROOT / ".venv-feast" / "bin" / "python"
FEAST_CLI = PROJECT_ROOT / ".venv-feast" / "bin" / "feast"
SUBJECT = "pm.features.device_window-value"


def _feast(*args: str, cwd=PROJECT_ROOT, program=FEAST_PYTHON, timeout: float = 120) -> str:
    assert program.exists(), f"{program} is missing: run `make setup` (it creates the Feast environment)"
    proc = subprocess.run([str(program), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _row(fs, device: str, window_end: int, rng: random.Random) -> dict:
    return {"device_id": device, "window_start": window_end - fs.window.size_ms, "window_end": window_end,
            "count": rng.randint(1, 50), **{name: rng.uniform(-100.0, 100.0) for name in fs.feature_names}}


def test_feast_registration_sync_and_online_reads(stack, tmp_path):
    fs = load_feature_set(DEFAULT_FEATURE_SET)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.features.device_window"
    redis_host = stack.redis_host or stack.host

    # 1. The repository, registered with Feast; Feast's own CLI sees it.
    applied = json.loads(_feast("-m", "streams.feast", "apply", "--home", str(tmp_path), "--project", prefix,
                                "--feature-set", str(DEFAULT_FEATURE_SET),
                                "--redis", f"{redis_host}:{stack.redis_port}").splitlines()[-1])
    assert {"Entity device", "PushSource device_window_push", "FeatureView device_window"} <= set(applied["applied"])
    repo = tmp_path / "feast" / "repo"
    listed = _feast("feature-views", "list", cwd=repo, program=FEAST_CLI)
    assert "device_window" in listed and "device" in listed, listed

    # 2. Feature rows on an isolated features topic: a newer and an older window out of order for one device.
    rng = random.Random(4)
    t0 = 1_760_000_000_000
    rows = [_row(fs, "dev-a", t0 + 5000, rng), _row(fs, "dev-b", t0 + 5000, rng),
            _row(fs, "dev-a", t0 + 10000, rng), _row(fs, "dev-c", t0 + 5000, rng),
            _row(fs, "dev-b", t0 + 10000, rng), _row(fs, "dev-b", t0, rng)]  # dev-b's oldest arrives last
    newest = {}
    for r in rows:
        if r["device_id"] not in newest or r["window_end"] > newest[r["device_id"]]["window_end"]:
            newest[r["device_id"]] = r
    create_topics(stack.kafka, [topic])
    out = codec(stack.registry_url, SUBJECT, load_schema(SUBJECT), register=True)
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True})
    for r in rows:
        producer.produce(topic, out.encode(r), r["device_id"])
    assert producer.flush(30) == 0, "not every row reached the topic"

    # 3. The bridge pushes them into Feast's online store, then stops.
    group = f"{prefix}.feast"
    sync = ["-m", "streams.feast", "sync", "--home", str(tmp_path), "--feature-set", str(DEFAULT_FEATURE_SET),
            "--bootstrap", stack.bootstrap_servers,
            "--registry", stack.registry_url, "--topic", topic, "--group", group]
    stats = json.loads(_feast(*sync, "--max-records", str(len(rows)), "--until-idle-s", "20").splitlines()[-1])
    assert stats["records"] == len(rows), stats

    # 4. Read back through Feast: every value equals the newest row produced for its device.
    got = json.loads(_feast("-m", "streams.feast", "get", "--home", str(tmp_path), "--feature-set", str(DEFAULT_FEATURE_SET),
                            "dev-a", "dev-b", "dev-c", "dev-unknown").splitlines()[-1])
    for device, read in zip(["dev-a", "dev-b", "dev-c"], got[:3], strict=True):
        expected = newest[device]
        assert read == {k: expected[k] for k in read}, (device, read, expected)
        assert set(read) == set(fs.columns)
    assert got[3]["device_id"] == "dev-unknown" and all(got[3][c] is None for c in fs.feature_names)

    # 5. Feast's Redis layout: one hash per entity and project, with the declared TTL, holding the
    #    very bytes the engines' writer encodes; the application's lookup reads Feast's writes.
    client = redis.Redis(host=redis_host, port=stack.redis_port)
    keys = [k for k in client.scan_iter(count=1000) if k.endswith(prefix.encode())]
    assert len(keys) == 3, keys
    assert all(0 < client.ttl(k) <= fs.online.ttl_s for k in keys)
    layout = FeastLayout.of(fs, prefix)
    for device in ("dev-a", "dev-b", "dev-c"):
        assert client.hgetall(layout.key(device)) == layout.encode_row(newest[device]), device
    ours = read_online_features(client, ["dev-a", "dev-b", "dev-c", "dev-unknown"], layout)
    assert ours == [{k: v for k, v in newest[d].items() if k != "device_id"} for d in ("dev-a", "dev-b", "dev-c")] + [{}]
    client.close()

    # 6. The offsets were committed after the push: the same group finds nothing left.
    again = json.loads(_feast(*sync, "--until-idle-s", "3").splitlines()[-1])
    assert again["records"] == 0, again
