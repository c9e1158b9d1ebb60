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

Each device has an entry in the fleet's register (``Device.register``: model, site, install date, status,
rated values), the table ``pm.devices`` the feature stage joins: the demo fleet takes one device out of
service and moves another to the other site partway through a run (``Change``, ``Fleet.table``), and the
readings a device sends while not ``online`` leave the stream at the feature stage, counted.

The same physics feeds the training script (``windows_for_training``) and the
live stream (``Fleet.tick``), so the model is trained on what it will see. ``FleetSimulator``
is the app's simulator as the runtime's demo, verify and backtests drive it (``streams.simulation``).
"""

from __future__ import annotations

import datetime
import json
import math
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, Sequence

import numpy as np
from pydantic import Field
from rich.table import Table

from streams.simulation import DeadLetter, Event, Observed, Scoreboard, Simulator, SimulatorSettings, TableVersion
from streams.topology import Topology

SENSORS: tuple[str, ...] = ("temperature", "vibration", "current", "pressure", "rpm")
MODEL_FAULTS: tuple[str, ...] = ("bearing_wear", "overheating")  # what the model learns to recognise
FAULTS: tuple[str, ...] = ("none", *MODEL_FAULTS, "sensor_dropout", "clock_skew", "malformed")
CLOCK_SKEW_MS = 120_000
RAMP_S = {"bearing_wear": 20.0, "overheating": 25.0}
SITES: tuple[str, ...] = ("plant-a", "plant-b")
INSTALLED_FROM = (datetime.date(2024, 1, 1) - datetime.date(1970, 1, 1)).days  # the fleet's first install date


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

    def register(self, site: str, status: str = "online") -> dict:
        """The device's entry in the fleet register (``pm.devices-value``): rated values from its operating point."""
        return {"device_id": self.device_id, "model": "P-100" if self.rpm0 < 1500 else "P-200", "site": site,
                "install_date": INSTALLED_FROM + int(self.phase * 100),  # Avro `date`: days since 1970-01-01
                "status": status, "rated_rpm": round(self.rpm0, -1), "rated_temperature": float(round(self.temp0)),
                "rated_current": round(self.current0, 1)}

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


@dataclass(frozen=True)
class Change:
    """A device's register entry changed ``at_s`` seconds into the run: its status, its site."""

    device_id: str
    at_s: float
    status: str | None = None
    site: str | None = None




class Fleet:
    """Devices sampled together at ``hz`` readings per second each, and their register over the run."""

    def __init__(self, devices: list[Device], hz: float = 10.0, seed: int = 7, run_id: str | None = None,
                 changes: Sequence[Change] = ()):
        self.devices = devices
        self.hz = hz
        self.rng = np.random.default_rng(seed)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.changes = sorted(changes, key=lambda c: c.at_s)
        #: readings sent while their device was not online, by "status=<status>": what the feature stage filters
        self.sent_not_online: Counter[str] = Counter()
        self._status = {d.device_id: "online" for d in devices}

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
        # two healthy devices, when there are: one moved to the other site, one taken out of service
        changes = [Change(devices[i].device_id, at_s, **change)
                   for i, at_s, change in ((len(plan) + 1, 10.0, {"site": SITES[0]}),
                                           (len(plan), 20.0, {"status": "maintenance"})) if i < n_devices]
        return cls(devices, hz, seed, changes=changes)

    def table(self, start_ms: int) -> list[tuple[str, dict, int]]:
        """The register over a run starting at ``start_ms``: every device (registered a minute before), then
        each change, as (device, entry, in effect from ms)."""
        entries = {d.device_id: d.register(SITES[i % len(SITES)]) for i, d in enumerate(self.devices)}
        out = [(device, entry, start_ms - 60_000) for device, entry in entries.items()]
        for change in self.changes:
            entry = entries[change.device_id] = {**entries[change.device_id],
                                                 **({"status": change.status} if change.status else {}),
                                                 **({"site": change.site} if change.site else {})}
            out.append((change.device_id, entry, start_ms + int(change.at_s * 1000)))
        return out

    def describe_changes(self) -> str:
        return ", ".join(f"{c.device_id} " + (f"to {c.status}" if c.status else f"moved to {c.site}")
                         + f" at +{c.at_s:g}s" for c in self.changes)

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
        for change in self.changes:
            if change.status and change.at_s <= k / self.hz:
                self._status[change.device_id] = change.status
        out = []
        for d in self.devices:
            if (status := self._status[d.device_id]) != "online" and d.fault not in ("clock_skew", "malformed"):
                self.sent_not_online[f"status={status}"] += 1
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


#: A window-aligned base time in the simulator's future-free past (2026-11-20), for recordings.
BASE_MS = 1_795_000_000_000


def recorded_readings(n_devices: int, seconds: float, *, hz: float = 10.0, seed: int = 7,
                      late_every: int = 97, swap_every: int = 13, straggle_every: int = 41) -> list[dict]:
    """A deterministic telemetry recording, with the disorder real fleets have, for engine tests and benchmarks.

    Readings (the ingest contract's fields) in arrival order, per device interleaved: readings swapped
    within a window (out of order), stragglers inside the allowed lateness, readings too late for any
    open window, and dropped sensor values.
    """
    rng = np.random.default_rng(seed)
    faults = ("none", "bearing_wear", "overheating", "sensor_dropout")
    devices = [Device.random(f"dev-{i:05d}", rng, faults[i % len(faults)], onset_s=seconds / 3)
               for i in range(n_devices)]
    n = int(seconds * hz)
    t = np.arange(n) / hz
    per_device: list[list[dict]] = []
    for d in devices:
        values = d.sample(t, rng)
        rows = []
        for i in range(n):
            rows.append({"event_id": f"{d.device_id}-{i}", "device_id": d.device_id,
                         "ts": BASE_MS + round(t[i] * 1000),
                         **{s: None if math.isnan(values[i, j]) else float(values[i, j]) for j, s in enumerate(SENSORS)}})
        for i in range(swap_every, n - 1, swap_every):  # out of order within the stream
            rows[i], rows[i + 1] = rows[i + 1], rows[i]
        for i in range(straggle_every, n, straggle_every):  # a straggler 1.2 s behind: inside the allowed lateness
            rows.insert(i, {**rows[i - 12], "event_id": f"{d.device_id}-s{i}", "ts": rows[i]["ts"] - 1200})
        for i in range(late_every, len(rows), late_every):  # 9 s behind: its window is closed, it is late
            rows.insert(i, {**rows[i], "event_id": f"{d.device_id}-l{i}", "ts": rows[i]["ts"] - 9000})
        per_device.append(rows)
    out = []
    for i in range(max(len(r) for r in per_device)):
        out.extend(rows[i] for rows in per_device if i < len(rows))
    return out


class TrainingWindows(NamedTuple):
    """Simulated windows and what is known of each: its label, its device's fault and register entry."""

    windows: np.ndarray  # (windows, samples, 5) in ``SENSORS`` order, NaN = missing
    labels: list[str]
    faults: list[str]
    registers: list[dict]  # the device's ``pm.devices`` entry (``Device.register``), online


def windows_for_training(
    n_devices: int, seconds: float, window_s: float, hz: float, seed: int, *, drifts: Sequence[Drift] = ()
) -> TrainingWindows:
    """Simulated readings cut into windows, with their labels, faults and register entries.

    ``drifts`` (none for training) are applied to every device, for drift measurements on the
    same population the model was trained on. A window is labelled with its device's fault once the fault is well under way
    (severity ≥ 0.35 at the window's end) and ``healthy`` otherwise; windows in
    the ambiguous first part of a ramp are left out so the classes stay clean.
    """
    rng = np.random.default_rng(seed)
    per_window = int(round(window_s * hz))
    windows, labels, faults, registers = [], [], [], []
    choices = ["none", "none", "bearing_wear", "overheating", "sensor_dropout"]
    for i in range(n_devices):
        fault = choices[i % len(choices)]
        onset = float(rng.uniform(0, seconds * 0.6)) if fault != "none" else math.inf
        device = Device.random(f"train-{i}", rng, fault, onset)
        if drifts:
            device = replace(device, drifts=tuple(drifts))
        register = device.register(SITES[i % len(SITES)])
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
            registers.append(register)
    return TrainingWindows(np.stack(windows), labels, faults, registers)


# -- the app's simulator, as the runtime's tools drive it (streams.simulation) -------------------------

#: What each injected fault should lead to: an action type, or a DLQ reason at ingest.
EXPECTED = {
    "bearing_wear": ("action", "maintenance"),
    "overheating": ("action", "alert"),
    "sensor_dropout": ("action", "review"),
    "clock_skew": ("dlq", "future_timestamp"),
}
#: The faults the rules act on (precision and recall count these).
ACTED_ON = ("bearing_wear", "overheating", "sensor_dropout")


class FleetSettings(SimulatorSettings):
    hz: float = Field(10.0, gt=0, description="Readings per second of each device.")


class FleetSimulator(Simulator):
    """The fleet as ``tangram demo``, ``verify`` and backtests run it: ``Fleet.demo`` with its faults."""

    Settings = FleetSettings

    def __init__(self, topology: Topology, settings: FleetSettings, *, entities: int, seed: int,
                 fleet: Fleet | None = None):
        super().__init__(topology, settings, entities=entities, seed=seed)
        self.fleet = fleet or Fleet.demo(n_devices=entities, hz=settings.hz, seed=seed)
        self.rng = np.random.default_rng(seed)

    @property
    def rate_hz(self) -> float:
        return self.fleet.hz

    def describe(self) -> str:
        faults = sorted({d.fault for d in self.fleet.devices} - {"none"})
        changes = self.fleet.describe_changes()
        return (f"{len(self.fleet.devices)} devices at {self.fleet.hz:g} Hz (faults: {', '.join(faults) or 'none'}"
                + (f"; register: {changes}" if changes else "") + ")")

    def tick(self, step: int, start_ms: int) -> list[Event]:
        return [Event(key, value, _event_id(value)) for key, value in self.fleet.tick(step, start_ms)]

    def truth(self, start_ms: int) -> list[tuple[str, dict]]:
        return [(label["device_id"], label) for label in self.fleet.labels(start_ms)]

    def table(self, start_ms: int) -> list[TableVersion]:
        return [TableVersion(device, entry, at_ms) for device, entry, at_ms in self.fleet.table(start_ms)]

    # -- verify -------------------------------------------------------------------------
    def probe(self, now_ms: int) -> tuple[Event, Event, str]:
        device = Device.random(f"verify-{uuid.uuid4().hex[:6]}", self.rng)
        (key, value), = Fleet([device], self.fleet.hz, seed=self.seed).tick(0, now_ms)
        return Event(key, value, _event_id(value)), Event(key, value[:-9]), "bad_json"  # truncated JSON

    def incident(self, start_ms: int) -> tuple[list[list[Event]], str]:
        """13 s of a device whose bearing has been wearing for a minute: at least one whole 5 s window,
        closed by the readings after it, that scores bearing_wear."""
        device = Device.random(f"verify-{uuid.uuid4().hex[:6]}", self.rng, "bearing_wear", onset_s=-60.0)
        fleet = Fleet([device], self.fleet.hz, seed=int(self.rng.integers(1 << 30)))
        steps = [[Event(k, v, _event_id(v)) for k, v in fleet.tick(step, start_ms)]
                 for step in range(int(13 * self.fleet.hz))]
        return steps, device.device_id

    def load(self, entities: int) -> "FleetSimulator":
        worn = [Device.random(f"load-w{i}-{uuid.uuid4().hex[:4]}", self.rng, "bearing_wear", onset_s=-60.0)
                for i in range(min(5, entities))]
        healthy = [Device.random(f"load-h{i}-{uuid.uuid4().hex[:4]}", self.rng) for i in range(entities - len(worn))]
        fleet = Fleet(worn + healthy, self.fleet.hz, seed=self.seed)
        return FleetSimulator(self.topology, self.settings, entities=entities, seed=self.seed, fleet=fleet)

    # -- scoring ------------------------------------------------------------------------
    def score(self, observed: Observed) -> Scoreboard:
        """Detected / missed per injected fault, detection delays and false alarms, against the labels."""
        faults, false_alarms = score_faults(observed.truth, observed.actions, observed.dead_letters,
                                            since_ms=observed.start_ms)
        table = Table(title="injected faults vs ground truth")
        for col in ("fault", "devices", "detected", "missed", "median delay after onset"):
            table.add_column(col, justify="right" if col != "fault" else "left")
        for fault, e in sorted(faults.items()):
            if fault in ("none", "malformed"):
                continue
            delay = f"{np.median(e['delays_s']):.1f}s" if e["delays_s"] else "-"
            table.add_row(fault, str(e["devices"]), str(e["detected"]), str(e["missed"]), delay)
        tp = sum(faults[f]["detected"] for f in ACTED_ON if f in faults)
        fn = sum(faults[f]["missed"] for f in ACTED_ON if f in faults)
        fp = len({a["device_id"] for a in false_alarms})
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        healthy = faults.get("none", {}).get("devices", 0)
        notes = [f"false alarms: {len(false_alarms)} (actions on the {healthy} healthy devices, or not matching a "
                 "device's fault, or before its onset)"]
        notes += [f"  {a['action_type']} {a['device_id']} rule={a['rule']} window_end={a['window_end']}"
                  for a in false_alarms]
        for why, sent in sorted(self.fleet.sent_not_online.items()):
            filtered = observed.filtered.get(why, 0)
            # the stage's counter starts with its process: on a stack that ran the app before, it also counts the
            # earlier run's last readings, read again as the stage started (at-least-once)
            again = (f" ({filtered - sent:,} more than sent: an earlier run's readings on this stack, read again "
                     "as the feature stage started)" if filtered > sent else "")
            notes.append(f"readings of devices not online ({why}): {sent:,} sent, "
                         f"{filtered:,} filtered out by the feature stage{again}")
        accuracy = attribute_accuracy(observed.model_cards)
        notes += [line for line, _ in accuracy.values()]
        delays = [d for f in faults.values() for d in f["delays_s"]]
        figures = {
            **{f"detected {f}": f"{faults[f]['detected']}/{faults[f]['devices']}" for f in ACTED_ON if f in faults},
            "median detection delay": f"{np.median(delays):.1f}s" if delays else "-",
            "false alarms": len(false_alarms),
            "precision / recall / F1": f"{precision:.2f} / {recall:.2f} / "
                                       f"{2 * precision * recall / (precision + recall) if precision + recall else 0.0:.2f}",
            "faults": faults,
            **{f"filtered {why}": f"{observed.filtered.get(why, 0)}/{sent}"
               for why, sent in sorted(self.fleet.sent_not_online.items())},
            **{f"{model} held-out accuracy with / without attributes / with defaults": figure
               for model, (_, figure) in accuracy.items()},
        }
        return Scoreboard(tables=[table], figures=figures, notes=notes)


def attribute_accuracy(cards: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """Model → (a line, a figure) of what its training measured (``pm_app.train``): held-out accuracy with the
    register's attributes, with the same training on the aggregates alone, and with the attribute defaults."""
    out = {}
    for model, card in sorted(cards.items()):
        try:
            with_, without, defaults = (card[k]["accuracy"] for k in
                                        ("metrics", "metrics_without_attributes", "metrics_with_defaults"))
        except (KeyError, TypeError):  # a card of another training script: nothing to compare
            continue
        out[model] = (f"model {model} v{card.get('version', '?')} ({card.get('dataset_version', '?')}), held-out "
                      f"accuracy over {card.get('test_windows', 0):,} windows: {with_:.4f} with the register's "
                      f"attributes ({', '.join(card.get('attributes', []))}), {without:.4f} trained without them, "
                      f"{defaults:.4f} with the defaults (an unregistered device)",
                      f"{with_:.4f} / {without:.4f} / {defaults:.4f}")
    return out


def _event_id(value: bytes) -> str:
    """The event id of a well-formed JSON reading (empty for a broken one)."""
    try:
        return str(json.loads(value)["event_id"])
    except (ValueError, KeyError, TypeError):
        return ""


def score_faults(labels: list[dict], actions: list[dict], dead_letters: list[DeadLetter],
                 since_ms: int = 0) -> tuple[dict, list[dict]]:
    """Detected / missed per injected fault (with delays), and the false alarms, against ``FaultLabel`` records.

    Actions for windows that ended before ``since_ms`` are ignored (windows an earlier run left open);
    actions about no device of the fleet (a drift alert about the pipeline itself) are neither.
    """
    by_device: dict[str, list[dict]] = defaultdict(list)
    for a in actions:
        if a["window_end"] > since_ms:
            by_device[a["device_id"]].append(a)
    dlq_by_device: dict[str, Counter] = defaultdict(Counter)
    for d in dead_letters:
        dlq_by_device[d.key][d.reason] += 1
    faults: dict[str, dict] = {}
    false_alarms: list[dict] = []
    for label in labels:
        device, fault = label["device_id"], label["fault"]
        onset_ms = label["onset_ts"] if fault != "none" else None
        expected = EXPECTED.get(fault)
        entry = faults.setdefault(fault, {"devices": 0, "detected": 0, "missed": 0, "delays_s": []})
        entry["devices"] += 1
        hit = None
        for a in sorted(by_device[device], key=lambda a: a["window_end"]):
            if expected and expected[0] == "action" and a["action_type"] == expected[1] and a["window_end"] >= onset_ms:
                hit = hit or a
            else:
                false_alarms.append(a)
        detected = dlq_by_device[device][expected[1]] > 0 if expected and expected[0] == "dlq" else hit is not None
        if expected:
            entry["detected" if detected else "missed"] += 1
            if hit is not None:
                entry["delays_s"].append((hit["window_end"] - onset_ms) / 1000)
    return faults, false_alarms
