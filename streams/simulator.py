"""A fleet of machines sending telemetry, with injected faults and ground-truth labels.

Each device is a small physical model: temperature, vibration, motor current,
line pressure and shaft speed around its own operating point, with sensor noise.
Faults change the physics from an onset time and grow over a ramp:

- ``bearing_wear``: vibration rises and gains a high-frequency component;
- ``overheating``: temperature climbs ~20 °C and the current draw rises;
- ``sensor_dropout``: about half the sensor values arrive as null;
- ``clock_skew``: the device clock runs two minutes ahead (ingest rejects it);
- ``malformed``: one reading in ten is broken (bad JSON, wrong types, missing fields, bad bytes).

Drift (``Drift``) is separate from faults: it changes the distribution of a sensor for every
device that carries it, from a chosen time, without being a fault the model knows — what the
drift jobs (``streams.monitor``) must notice: a ``shift`` (offset), a ``scale`` (multiplier) or
a new ``category`` (a share of readings at a level never seen in training: a new sensor type,
a recalibrated unit).

The same physics feeds the training script (``windows_for_training``) and the
live stream (``Fleet.tick``), so the model is trained on what it will see.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Iterator, Literal, Sequence

import numpy as np

SENSORS: tuple[str, ...] = ("temperature", "vibration", "current", "pressure", "rpm")
MODEL_FAULTS: tuple[str, ...] = ("bearing_wear", "overheating")  # what the model learns to recognise
FAULTS: tuple[str, ...] = ("none", *MODEL_FAULTS, "sensor_dropout", "clock_skew", "malformed")
CLOCK_SKEW_MS = 120_000
RAMP_S = {"bearing_wear": 20.0, "overheating": 25.0}


@dataclass(frozen=True)
class Drift:
    """A change of one sensor's distribution from ``start_s`` (seconds into the run) on.

    ``shift``: value + amount; ``scale``: mean + (value - mean) * amount around the device's own
    operating point for the sensor, i.e. more (or less) spread; ``category``: a share ``share``
    of readings replaced by the level ``amount`` (a category the training data never had).
    """

    sensor: str
    kind: Literal["shift", "scale", "category"]
    amount: float
    start_s: float = 0.0
    share: float = 0.2

    def __post_init__(self) -> None:
        if self.sensor not in SENSORS:
            raise ValueError(f"unknown sensor {self.sensor!r}; known: {', '.join(SENSORS)}")
        if self.kind not in ("shift", "scale", "category"):
            raise ValueError(f"unknown drift kind {self.kind!r}; known: shift, scale, category")
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"drift share must be in (0, 1], got {self.share}")

    def apply(self, t: np.ndarray, values: np.ndarray, centre: float, rng: np.random.Generator) -> np.ndarray:
        """``values`` of this sensor at times ``t`` with the drift applied where ``t >= start_s``."""
        on = t >= self.start_s
        if not on.any():
            return values
        out = values.copy()
        if self.kind == "shift":
            out[on] = values[on] + self.amount
        elif self.kind == "scale":
            out[on] = centre + (values[on] - centre) * self.amount
        else:
            hit = on & (rng.random(len(t)) < self.share)
            out[hit] = self.amount
        return out


@dataclass(frozen=True)
class Device:
    """One machine: its operating point, its fault and when the fault begins (seconds into the run)."""

    device_id: str
    temp0: float
    vib0: float
    current0: float
    pressure0: float
    rpm0: float
    phase: float
    fault: str = "none"
    onset_s: float = math.inf
    drifts: tuple[Drift, ...] = ()

    @classmethod
    def random(cls, device_id: str, rng: np.random.Generator, fault: str = "none", onset_s: float = math.inf) -> "Device":
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        return cls(
            device_id=device_id,
            temp0=float(rng.uniform(58, 64)),
            vib0=float(rng.uniform(1.5, 2.5)),
            current0=float(rng.uniform(10, 14)),
            pressure0=float(rng.uniform(4, 6)),
            rpm0=float(rng.uniform(1400, 1600)),
            phase=float(rng.uniform(0, 2 * math.pi)),
            fault=fault,
            onset_s=onset_s if fault != "none" else math.inf,
        )

    def severity(self, t_s: float) -> float:
        """0 before the onset, rising linearly to 1 over the fault's ramp."""
        if t_s < self.onset_s or self.fault not in RAMP_S:
            return 0.0
        return min(1.0, (t_s - self.onset_s) / RAMP_S[self.fault])

    def sample(self, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Readings at times ``t`` (seconds), shape (len(t), 5) in ``SENSORS`` order; NaN = dropped."""
        n = len(t)
        sev = np.array([self.severity(x) for x in t]) if self.fault in RAMP_S else np.zeros(n)
        temp = self.temp0 + 0.5 * np.sin(2 * np.pi * t / 300 + self.phase) + rng.normal(0, 0.3, n)
        vib = self.vib0 * (1 + 0.3 * np.sin(2 * np.pi * 1.0 * t + self.phase)) + rng.normal(0, 0.15, n)
        current = self.current0 + rng.normal(0, 0.2, n)
        pressure = self.pressure0 + rng.normal(0, 0.05, n)
        rpm = self.rpm0 + rng.normal(0, 5, n)
        if self.fault == "bearing_wear":
            vib = vib + sev * (2.0 + 3.0 * np.sin(2 * np.pi * 4.0 * t + self.phase)) + rng.normal(0, 0.5, n) * sev
            rpm = rpm - 20 * sev
        elif self.fault == "overheating":
            temp = temp + 20.0 * sev
            current = current + 2.0 * sev
        out = np.column_stack([temp, np.abs(vib), current, pressure, rpm])
        if self.drifts:
            centres = (self.temp0, self.vib0, self.current0, self.pressure0, self.rpm0)
            for drift in self.drifts:
                j = SENSORS.index(drift.sensor)
                out[:, j] = drift.apply(t, out[:, j], centres[j], rng)
        if self.fault == "sensor_dropout" and np.isfinite(self.onset_s):
            dropped = (rng.random(out.shape) < 0.5) & (t[:, None] >= self.onset_s)
            out[dropped] = np.nan
        return out


class Fleet:
    """Devices sampled together at ``hz`` readings per second each."""

    def __init__(self, devices: list[Device], hz: float = 10.0, seed: int = 7, run_id: str | None = None):
        self.devices = devices
        self.hz = hz
        self.rng = np.random.default_rng(seed)
        self.run_id = run_id or uuid.uuid4().hex[:12]

    @classmethod
    def demo(cls, n_devices: int = 20, hz: float = 10.0, seed: int = 7) -> "Fleet":
        """The demo fleet: every fault at least once, the rest healthy."""
        rng = np.random.default_rng(seed)
        plan = [
            ("bearing_wear", 12.0), ("bearing_wear", 18.0), ("bearing_wear", 24.0),
            ("overheating", 10.0), ("overheating", 20.0),
            ("sensor_dropout", 15.0), ("clock_skew", 0.0), ("malformed", 0.0),
        ]
        devices = []
        for i in range(n_devices):
            fault, onset = plan[i] if i < len(plan) else ("none", math.inf)
            devices.append(Device.random(f"dev-{i:04d}", rng, fault, onset))
        return cls(devices, hz, seed)

    def labels(self, start_ms: int) -> list[dict]:
        """Ground truth: one ``FaultLabel`` per device."""
        return [
            {
                "device_id": d.device_id,
                "fault": d.fault,
                "onset_ts": start_ms + int(d.onset_s * 1000) if math.isfinite(d.onset_s) else 0,
                "run_id": self.run_id,
            }
            for d in self.devices
        ]

    def tick(self, k: int, start_ms: int) -> list[tuple[str, bytes]]:
        """The JSON readings of sample step ``k`` for every device: (key, value bytes)."""
        t = np.array([k / self.hz])
        ts = start_ms + int(k * 1000 / self.hz)
        out = []
        for d in self.devices:
            row = d.sample(t, self.rng)[0]
            reading = {
                "event_id": uuid.uuid4().hex,
                "device_id": d.device_id,
                "ts": ts + (CLOCK_SKEW_MS if d.fault == "clock_skew" else 0),
            }
            reading.update({s: None if math.isnan(v) else round(float(v), 4) for s, v in zip(SENSORS, row)})
            value = json.dumps(reading).encode()
            if d.fault == "malformed" and self.rng.random() < 0.1:
                value = self._break(reading)
            out.append((d.device_id, value))
        return out

    def _break(self, reading: dict) -> bytes:
        kind = int(self.rng.integers(0, 5))
        if kind == 0:
            return json.dumps(reading).encode()[:-7]  # truncated JSON
        if kind == 1:
            return json.dumps({**reading, "temperature": "hot"}).encode()  # wrong type
        if kind == 2:
            return json.dumps({k: v for k, v in reading.items() if k != "device_id"}).encode()  # missing field
        if kind == 3:
            return json.dumps({**reading, "vibration": 1e6}).encode()  # out of range
        return b"\xff\xfe" + json.dumps(reading).encode()  # not UTF-8

    def run(self, send, duration_s: float, start_ms: int | None = None, *, realtime: bool = True) -> Iterator[int]:
        """Call ``send(key, value)`` for every reading for ``duration_s`` of event time; yields sent counts per step."""
        start_ms = start_ms if start_ms is not None else int(time.time() * 1000)
        t0 = time.monotonic()
        for k in range(int(duration_s * self.hz)):
            if realtime and (delay := t0 + k / self.hz - time.monotonic()) > 0:
                time.sleep(delay)
            readings = self.tick(k, start_ms)
            for key, value in readings:
                send(key, value)
            yield len(readings)


def windows_for_training(
    n_devices: int, seconds: float, window_s: float, hz: float, seed: int, *, drifts: Sequence[Drift] = ()
) -> tuple[np.ndarray, list[str], list[str]]:
    """Simulated readings cut into windows: (array of shape (windows, samples, 5), labels, faults).

    ``drifts`` (none for training) are applied to every device, for drift measurements on the
    same population the model was trained on. A window is labelled with its device's fault once the fault is well under way
    (severity ≥ 0.35 at the window's end) and ``healthy`` otherwise; windows in
    the ambiguous first part of a ramp are left out so the classes stay clean.
    """
    rng = np.random.default_rng(seed)
    per_window = int(round(window_s * hz))
    windows, labels, faults = [], [], []
    choices = ["none", "none", "bearing_wear", "overheating", "sensor_dropout"]
    for i in range(n_devices):
        fault = choices[i % len(choices)]
        onset = float(rng.uniform(0, seconds * 0.6)) if fault != "none" else math.inf
        device = Device.random(f"train-{i}", rng, fault, onset)
        if drifts:
            device = replace(device, drifts=tuple(drifts))
        t = np.arange(int(seconds * hz)) / hz
        values = device.sample(t, rng)
        for w in range(len(t) // per_window):
            end_t = t[(w + 1) * per_window - 1]
            sev = device.severity(end_t)
            if fault in MODEL_FAULTS:
                if 0 < sev < 0.35:
                    continue
                label = fault if sev >= 0.35 else "healthy"
            else:
                label = "healthy"
            windows.append(values[w * per_window:(w + 1) * per_window])
            labels.append(label)
            faults.append(fault)
    return np.stack(windows), labels, faults
