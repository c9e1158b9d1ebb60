"""`tangram init`: a new app that runs end to end on the real stack with no edit, tested with the app harness."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from streams.lifecycle.repository import build_models
from streams.testing import AppHarness
from streams.topology import load_topology

pytestmark = pytest.mark.integration


def test_a_scaffolded_app_runs_end_to_end_with_no_edit(stack, tmp_path):
    folder = tmp_path / "shop"
    made = subprocess.run([sys.executable, "-m", "streams", "init", "shop", "--dir", str(folder)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "tangram models build" in made.stdout
    print(build_models(load_topology(folder)))  # the app's own models.build hook: its tiny ONNX model

    now = int(time.time() * 1000)
    events = [{"event_id": f"{entity}-{i}", "entity": entity, "ts": now - 14_000 + i * 1000, "value": value}
              for entity, value in (("hot-1", 80.0), ("calm-1", 10.0)) for i in range(14)]
    events.append({"event_id": "broken", "entity": "hot-1", "ts": now, "value": "eighty"})  # off contract
    with AppHarness(folder, stack) as app:
        app.send("shop.raw.events", events, key="entity")
        assert app.read("shop.actions.alert", count=1, timeout_s=90.0), "no alert within 90 s"
        alerts = app.read("shop.actions.alert", idle_s=5.0)  # and whatever else came (the calm entity: nothing)
        windows = app.read("shop.features.window", idle_s=2.0)
        refused = app.read("shop.dlq.ingest", count=1, idle_s=5.0)
    # 14 s of events close two windows of each entity; only the hot entity's windows are high
    assert len(windows) >= 4 and {w["entity"] for w in windows} == {"hot-1", "calm-1"}
    assert alerts and {a["entity"] for a in alerts} == {"hot-1"}
    assert all(a["rule"] == "high_value" and a["label"] == "high" and a["model_name"] == "shop_score" for a in alerts)
    assert [dict(m.headers())["dlq.reason"] for m in refused] == [b"schema"]
