"""Feature jobs (seed node 2): per-device event-time windows → features topic and Redis online store.

``window_features`` is the one definition of the features, used by the live job
and by the training script alike, so training and serving cannot drift apart.

``WindowFeatures`` is the embedded engine of the walking skeleton: tumbling
event-time windows per device, closed when the device's watermark (its newest
event time) passes the window end plus the allowed lateness. Readings for a
window already closed are late: counted and sent to the DLQ, never dropped.

State and offsets: open windows live in memory; the committed offset of a
partition never passes the first offset of a window still open there, so a
restarted job rebuilds its windows by re-reading. Windows already emitted are
recognised by the ``window_end`` stored with the device in the online store
(written after the broker acknowledged the window, before the commit) and are
not emitted twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import redis
from confluent_kafka import TopicPartition
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from streams.avro import AvroCodec, WireFormatError
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, H_TRACE_ID, Output, Processor, Record, carry_headers, dead_letter
from streams.simulator import SENSORS

log = logging.getLogger("tangram.features")

AGGREGATIONS: tuple[str, ...] = ("mean", "std", "min", "max", "ptp")
#: The model's input vector, in order.
FEATURE_NAMES: tuple[str, ...] = (
    "missing_rate",
    *(f"{s}_{a}" for s in SENSORS for a in AGGREGATIONS),
    "vibration_band_energy",
)
BAND_CUT_HZ = 2.5
LATE = Counter("tangram_features_late_records_total", "Readings that arrived after their window closed.", ["processor"])


def window_features(values: np.ndarray, hz: float) -> dict[str, float]:
    """Features of one window. ``values`` has shape (samples, len(SENSORS)); NaN marks a dropped value."""
    values = np.asarray(values, dtype=np.float64)
    present = ~np.isnan(values)
    out: dict[str, float] = {"missing_rate": float(1.0 - present.mean()) if values.size else 1.0}
    for j, sensor in enumerate(SENSORS):
        col = values[present[:, j], j]
        if col.size:
            lo, hi = float(col.min()), float(col.max())
            stats = (float(col.mean()), float(col.std()), lo, hi, hi - lo)
        else:
            stats = (0.0, 0.0, 0.0, 0.0, 0.0)
        out.update({f"{sensor}_{a}": v for a, v in zip(AGGREGATIONS, stats)})
    out["vibration_band_energy"] = band_energy(values[:, SENSORS.index("vibration")], hz)
    return out


def band_energy(signal: np.ndarray, hz: float, cut_hz: float = BAND_CUT_HZ) -> float:
    """Share of the signal's spectral energy (DC removed) at or above ``cut_hz``."""
    x = signal[~np.isnan(signal)]
    if x.size < 4:
        return 0.0
    power = np.abs(np.fft.rfft(x - x.mean())) ** 2
    freqs = np.fft.rfftfreq(x.size, d=1.0 / hz)
    total = power[1:].sum()
    return float(power[freqs >= cut_hz].sum() / total) if total > 1e-12 else 0.0


def feature_vector(features: dict[str, float]) -> list[float]:
    return [float(features[name]) for name in FEATURE_NAMES]


class WindowFeaturesSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    window_ms: int = Field(5000, ge=100, description="Tumbling window size (event time).")
    allowed_lateness_ms: int = Field(1000, ge=0, description="How long after its end a window waits for stragglers.")
    sample_hz: float = Field(10.0, gt=0, description="Nominal reading rate, for the spectral features.")
    online_store_ttl_s: int = Field(3600, ge=1, description="TTL of a device's features in Redis.")
    key_prefix: str | None = Field(None, description="Redis key prefix of the online store; default `tangram:<app>:<processor>`.")


@dataclass
class _Window:
    start: int
    partition: TopicPartition
    first_offset: int
    ts: list[int] = field(default_factory=list)
    rows: list[list[float]] = field(default_factory=list)
    last: Record | None = None


def online_prefix(app: str, processor: str) -> str:
    """Where a feature processor keeps its online features in Redis."""
    return f"tangram:{app}:{processor}"


def online_key(prefix: str, device_id: str) -> str:
    return f"{prefix}:{device_id}"


class WindowFeatures(Processor):
    """Telemetry (Avro) → ``DeviceWindow`` (Avro) per device and window, and the Redis online store."""

    name = "features"

    def __init__(self, *, input_codec: AvroCodec, output_codec: AvroCodec, output_topic: str, dlq_topic: str,
                 redis_url: str, settings: WindowFeaturesSettings):
        self.input_codec = input_codec
        self.output_codec = output_codec
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.settings = settings
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._open: dict[str, dict[int, _Window]] = {}  # device → window start → window
        self._watermark: dict[str, int] = {}  # device → newest event time seen
        self._emitted: dict[str, int] = {}  # device → end of the newest window emitted
        self._pending_store: list[dict] = []

    @classmethod
    def build(cls, ctx: BuildContext) -> "WindowFeatures":
        (source,), (output,) = ctx.spec.inputs, ctx.spec.outputs
        return cls(input_codec=ctx.codec(source), output_codec=ctx.codec(output), output_topic=output,
                   dlq_topic=ctx.dlq, redis_url=ctx.stack.redis_url,
                   settings=WindowFeaturesSettings.model_validate(
                       {"key_prefix": online_prefix(ctx.topology.app, ctx.name), **ctx.spec.params}))

    def setup(self) -> None:
        self.redis.ping()

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        decoded: list[tuple[Record, dict]] = []
        for record in batch:
            try:
                decoded.append((record, self.input_codec.decode(record.value)))
            except WireFormatError as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
        self._load_emitted({value["device_id"] for _, value in decoded})
        size = self.settings.window_ms
        for record, value in decoded:
            device, ts = value["device_id"], value["ts"]
            start = ts - ts % size
            if start + size <= self._emitted.get(device, -1) or self._closed(device, start):
                LATE.labels(self.name).inc()
                outputs.append(dead_letter(record, self.dlq_topic, self.name,
                                           f"reading at {ts} is late: window [{start}, {start + size}) already closed",
                                           "late"))
                continue
            window = self._open.setdefault(device, {}).get(start)
            if window is None:
                window = _Window(start, TopicPartition(record.topic, record.partition), record.offset)
                self._open[device][start] = window
            window.ts.append(ts)
            window.rows.append([np.nan if value[s] is None else value[s] for s in SENSORS])
            window.last = record
            if ts > self._watermark.get(device, -1):
                self._watermark[device] = ts
                outputs.extend(self._close_ready(device, record))
        return outputs

    def _closed(self, device: str, start: int) -> bool:
        """A window is closed once the watermark passed its end plus the lateness (and it is not open)."""
        wm = self._watermark.get(device, -1)
        return start not in self._open.get(device, {}) and start + self.settings.window_ms + self.settings.allowed_lateness_ms <= wm

    def _close_ready(self, device: str, trigger: Record) -> list[Output]:
        wm = self._watermark[device]
        size, lateness = self.settings.window_ms, self.settings.allowed_lateness_ms
        ready = sorted(s for s in self._open[device] if s + size + lateness <= wm)
        outputs = []
        for start in ready:
            window = self._open[device].pop(start)
            order = np.argsort(np.asarray(window.ts), kind="stable")
            feats = window_features(np.asarray(window.rows)[order], self.settings.sample_hz)
            row = {"device_id": device, "window_start": start, "window_end": start + size, "count": len(window.ts), **feats}
            headers = carry_headers(trigger, **{H_EVENT_ID: f"{device}:{start}"})
            if H_TRACE_ID not in headers and window.last is not None:
                headers.update(carry_headers(window.last))
            outputs.append(Output(self.output_topic, device, self.output_codec.encode(row), headers))
            self._pending_store.append(row)
            self._emitted[device] = max(self._emitted.get(device, -1), start + size)
        return outputs

    def _load_emitted(self, devices: set[str]) -> None:
        """For devices first seen since start, read which windows were already emitted (online store)."""
        new = [d for d in devices if d not in self._emitted]
        if not new:
            return
        pipe = self.redis.pipeline(transaction=False)
        for device in new:
            pipe.hget(online_key(self.settings.key_prefix, device), "window_end")
        for device, end in zip(new, pipe.execute()):
            self._emitted[device] = int(end) if end is not None else -1

    def flush(self) -> None:
        """Write the emitted windows to the online store (after the broker acknowledged them)."""
        if not self._pending_store:
            return
        pipe = self.redis.pipeline(transaction=False)
        for row in self._pending_store:
            key = online_key(self.settings.key_prefix, row["device_id"])
            pipe.hset(key, mapping={k: v for k, v in row.items() if k != "device_id"})
            pipe.expire(key, self.settings.online_store_ttl_s)
        pipe.execute()
        self._pending_store.clear()

    def committable(self, partition: TopicPartition) -> int | None:
        firsts = [w.first_offset for windows in self._open.values() for w in windows.values() if w.partition == partition]
        return min(firsts) if firsts else None

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        for device in list(self._open):
            self._open[device] = {s: w for s, w in self._open[device].items()
                                  if (w.partition.topic, w.partition.partition) not in gone}
        self._watermark.clear()
        self._emitted.clear()

    def close(self) -> None:
        self.redis.close()


def read_online_features(client: redis.Redis, device_ids: list[str], prefix: str) -> list[dict[str, float]]:
    """The latest window features of each device from the online store ({} when unknown)."""
    pipe = client.pipeline(transaction=False)
    for device in device_ids:
        pipe.hgetall(online_key(prefix, device))
    return [{k.decode(): float(v) for k, v in raw.items()} for raw in pipe.execute()]
