"""The predictive-maintenance job written with Quix Streams, the way a user would write it.

The peer of Tangram's reference topology in ``benchmarks/bench_e2e.py``: the same JSON readings in,
the same validation (JSON, required fields and types, ranges, size, timestamp sanity, dedup by
``event_id``; rejects to a DLQ with the original bytes), 5 s tumbling event-time windows per device
with 1 s grace closed per key, the same 27 window features followed by the same 3 device attributes (the
fleet register's rated values: the benchmark's fleet is in no register, so every window carries the feature
set's defaults, which the benchmark passes in ``--attributes``), the same ONNX model in process (onnxruntime,
one window per call), the same three rules with a 30 s cooldown per device and action (event time),
predictions and actions out as JSON. Quix's defaults otherwise: RocksDB state with changelog topics,
at-least-once, a commit every 5 s. One process, one consumer-group member.

Runs in its own environment (``.venv-quix``: quixstreams pins an older confluent-kafka)::

    .venv-quix/bin/python benchmarks/peers/quix_app.py --broker 127.0.0.1:9092 --source RAW --prefix qx1 \\
        --model topologies/predictive_maintenance/model_repository/anomaly/1/model.onnx --state-dir /tmp/qx1 \\
        --attributes 61.0,12.0,1500.0

It prints one line, ``first-record-at <epoch seconds>``, when it reads its first reading: the
benchmark's clock starts there, as it does at the first record for Tangram and the raw loop.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import onnxruntime as ort
from quixstreams import Application
from quixstreams.state import State

SENSORS = ("temperature", "vibration", "current", "pressure", "rpm")
RANGES = {"temperature": (-40.0, 200.0), "vibration": (0.0, 100.0), "current": (0.0, 500.0),
          "pressure": (0.0, 50.0), "rpm": (0.0, 10000.0)}
STATS = ("mean", "std", "min", "max", "ptp")
CLASSES = ("healthy", "bearing_wear", "overheating")
WINDOW_MS, GRACE_MS, HZ, BAND_CUT_HZ = 5000, 1000, 10.0, 2.5
MAX_BYTES, MAX_FUTURE_MS, MAX_AGE_MS, DEDUP = 4096, 30_000, 3_600_000, 100_000
COOLDOWN_MS = 30_000


class Validator:
    """Readings that pass the contract, as dicts; the rest go to the DLQ with their bytes and the reason."""

    def __init__(self) -> None:
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def reason(self, raw: bytes) -> tuple[str | None, dict | None]:
        if len(raw) > MAX_BYTES:
            return "oversize", None
        try:
            reading = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return "bad_json", None
        if not isinstance(reading, dict) or not isinstance(reading.get("event_id"), str) \
                or not isinstance(reading.get("device_id"), str) or not isinstance(reading.get("ts"), int):
            return "schema", None
        for sensor in SENSORS:
            value = reading.get(sensor)
            if value is None:
                continue
            if not isinstance(value, (int, float)):
                return "schema", None
            lo, hi = RANGES[sensor]
            if not lo <= value <= hi:
                return "out_of_range", None
        now = time.time() * 1000
        if reading["ts"] > now + MAX_FUTURE_MS:
            return "future_timestamp", None
        if reading["ts"] < now - MAX_AGE_MS:
            return "too_old", None
        if reading["event_id"] in self.seen:
            return "duplicate", None
        self.seen[reading["event_id"]] = None
        if len(self.seen) > DEDUP:
            self.seen.popitem(last=False)
        return None, reading


def band_energy(signal: np.ndarray) -> float:
    x = signal[~np.isnan(signal)]
    if x.size < 4:
        return 0.0
    power = np.abs(np.fft.rfft(x - x.mean())) ** 2
    freqs = np.fft.rfftfreq(x.size, d=1.0 / HZ)
    total = power[1:].sum()
    return float(power[freqs >= BAND_CUT_HZ].sum() / total) if total > 1e-12 else 0.0


def features(window: dict) -> dict:
    """The 27 window features of a closed window, in the model's input order."""
    readings = sorted(window["value"], key=lambda r: r["ts"])
    values = np.array([[np.nan if r.get(s) is None else r[s] for s in SENSORS] for r in readings], dtype=np.float64)
    present = ~np.isnan(values)
    out = {"device_id": readings[0]["device_id"], "window_start": window["start"], "window_end": window["end"],
           "count": len(readings), "missing_rate": float(1.0 - present.mean())}
    for j, sensor in enumerate(SENSORS):
        col = values[present[:, j], j]
        for stat in STATS:
            if not col.size:
                out[f"{sensor}_{stat}"] = 0.0
            elif stat == "ptp":
                out[f"{sensor}_{stat}"] = float(col.max()) - float(col.min())
            else:
                out[f"{sensor}_{stat}"] = float(getattr(col, stat)())
    out["vibration_band_energy"] = band_energy(values[:, SENSORS.index("vibration")])
    return out


FEATURES = ("missing_rate", *(f"{s}_{t}" for s in SENSORS for t in STATS), "vibration_band_energy")


class Model:
    """The model on one window: its features, then its device's attributes (the same for every device here)."""

    def __init__(self, path: str, attributes: list[float]):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        self.attributes = attributes

    def predict(self, row: dict) -> dict:
        x = np.array([[*(row[f] for f in FEATURES), *self.attributes]], dtype=np.float32)
        p = self.session.run(["probabilities"], {"features": x})[0][0]
        best = int(p.argmax())
        return {"device_id": row["device_id"], "window_start": row["window_start"], "window_end": row["window_end"],
                "label": CLASSES[best], "confidence": float(p[best]), "score": float(1.0 - p[0]),
                "missing_rate": row["missing_rate"]}


def decide(prediction: dict, state: State) -> list[dict]:
    """The reference rules (L0) with a cooldown per device and action type, in event time."""
    fired = []
    if prediction["label"] == "bearing_wear" and prediction["confidence"] >= 0.8:
        fired.append(("maintenance", "bearing_wear"))
    if prediction["label"] == "overheating" and prediction["confidence"] >= 0.8:
        fired.append(("alert", "overheating"))
    if prediction["missing_rate"] > 0.3:
        fired.append(("review", "poor_data"))
    actions = []
    end = prediction["window_end"]
    for action, rule in fired:
        last = state.get(action)
        if last is not None and 0 <= end - last < COOLDOWN_MS:
            continue
        state.set(action, end)
        actions.append({"action_type": action, "rule": rule, "device_id": prediction["device_id"],
                        "window_end": end, "label": prediction["label"], "score": prediction["score"]})
    return actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", required=True)
    parser.add_argument("--source", required=True, help="the raw JSON readings topic")
    parser.add_argument("--prefix", required=True, help="prefix of this run's topics and consumer group")
    parser.add_argument("--model", required=True, help="the ONNX file Triton serves")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--attributes", required=True,
                        help="the device attributes every window takes, comma-separated, in the model's order")
    args = parser.parse_args()

    app = Application(broker_address=args.broker, consumer_group=f"{args.prefix}.quix",
                      auto_offset_reset="earliest", state_dir=args.state_dir, loglevel="WARNING")
    raw = app.topic(args.source, value_deserializer="bytes", key_deserializer="str")
    dlq = app.topic(f"{args.prefix}.dlq", value_serializer="bytes")
    predictions = app.topic(f"{args.prefix}.predictions", value_serializer="json")
    actions = app.topic(f"{args.prefix}.actions", value_serializer="json")
    validator, model = Validator(), Model(args.model, [float(v) for v in args.attributes.split(",")])
    first = [True]

    def checked(raw_value: bytes) -> dict:
        if first[0]:
            first[0] = False
            print(f"first-record-at {time.time():.6f}", flush=True)
        reason, reading = validator.reason(raw_value)
        return {"reason": reason, "reading": reading, "raw": raw_value}

    sdf = app.dataframe(raw).apply(checked)
    sdf[sdf["reason"].notnull()].apply(lambda v: v["raw"]).to_topic(dlq)
    readings = sdf[sdf["reason"].isnull()].apply(lambda v: v["reading"])
    readings = readings.set_timestamp(lambda value, key, timestamp, headers: value["ts"])
    windows = readings.tumbling_window(WINDOW_MS, grace_ms=GRACE_MS).collect().final(closing_strategy="key")
    scored = windows.apply(features).apply(model.predict)
    scored.to_topic(predictions)
    scored.apply(decide, stateful=True, expand=True).to_topic(actions)
    app.run()


if __name__ == "__main__":
    main()
