"""A shadow feature set runs beside the live one: compared and sampled, never served."""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis
import yaml
from prometheus_client import REGISTRY

from streams.avro import codec
from streams.context import BuildContext
from streams.delivery import Record
from streams.features import online_layout, read_online_features
from streams.plan import apply
from pm_app.simulator import SENSORS, Device
from streams.topology import Topology
from reference import load_schema

from isolation import isolated_topology

pytestmark = pytest.mark.integration


def shadow_rows(result: str) -> float:
    return REGISTRY.get_sample_value("tangram_features_shadow_rows_total", {"processor": "features", "result": result}) or 0.0


def test_shadow_version_is_compared_and_never_served(stack, tmp_path):
    path, prefix = isolated_topology(tmp_path)
    doc = yaml.safe_load(path.read_text())
    shadow_topic = f"{prefix}.features.device_window_shadow"
    doc["topics"][shadow_topic] = {"format": "json", "description": "v2 rows that differ from v1"}
    features = doc["processors"]["features"]
    features["outputs"].append(shadow_topic)
    features["params"].update({"shadow_feature_set": "features/device_window_v2.yaml",
                               "shadow_topic": shadow_topic})
    topology = Topology.model_validate(doc)
    apply(topology, stack)
    processor = topology.load_object(topology.processors["features"].kind).build(BuildContext(topology, "features", stack))
    processor.name = "features"
    processor.setup()

    telemetry = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    rng = np.random.default_rng(4)
    devices = [Device.random("worn", rng, "bearing_wear", onset_s=-30.0), Device.random("fine", rng)]
    t0 = 1_800_000_000_000
    records, offset = [], 0
    for k in range(130):  # 13 s at 10 Hz: two windows of each device close, plus lateness
        for d in devices:
            values = d.sample(np.array([k / 10]), rng)[0]
            reading = {"event_id": f"{d.device_id}-{k}", "device_id": d.device_id, "ts": t0 + 100 * k,
                       **{s: float(v) for s, v in zip(SENSORS, values)}}
            records.append(Record(f"{prefix}.ingest.telemetry", 0, offset, d.device_id.encode(), telemetry.encode(reading),
                                  {"trace_id": b"0" * 32}, t0 + 100 * k))
            offset += 1
    before = {r: shadow_rows(r) for r in ("same", "different")}
    outputs = processor.process(records)
    processor.flush().result()  # the online write, done in the writer's thread
    try:
        live = [o for o in outputs if o.topic == f"{prefix}.features.device_window"]
        shadow = [o for o in outputs if o.topic == shadow_topic]
        assert len(live) == 4  # two windows × two devices, served
        assert shadow, "the shadow version differs in its band cut: differences must be sampled"
        for out in shadow:
            diff = json.loads(out.value)
            assert set(diff["differences"]) == {"vibration_band_energy"}
            assert (diff["live_version"], diff["shadow_version"]) == (1, 2)
        compared = sum(shadow_rows(r) - before[r] for r in ("same", "different"))
        assert compared == 4
        # the online store holds the live version only
        window_codec = codec(stack.registry_url, "pm.features.device_window-value",
                             load_schema("pm.features.device_window-value"))
        last_live = {window_codec.decode(o.value)["device_id"]: window_codec.decode(o.value) for o in live}
        client = redis.Redis.from_url(stack.redis_url)
        online = read_online_features(client, ["worn", "fine"], online_layout(topology))
        client.close()
        for device, served in zip(["worn", "fine"], online):
            assert served["vibration_band_energy"] == pytest.approx(last_live[device]["vibration_band_energy"], rel=1e-12)
    finally:
        processor.close()
