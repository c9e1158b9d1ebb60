"""Reading → action latency of the reference chain, open loop at 10 % and 50 % of its maximum rate.

The maximum rate is the chain's catch-up rate (``bench_e2e.tangram``, one replica per stage) measured
first in the same run, or given with ``--max-rate``. For each share a fleet of ``rate / 10`` devices
(10 Hz each, many with faults from the start, so that actions flow) sends readings on a fixed schedule
(open loop: a slow pipeline does not slow the sender) into a fresh namespace of the reference topology
whose rules have no cooldown, so that every window judged faulty yields an action.

Latency runs from the producer's send time of the reading that closed a window (the first reading of the
window's partition, of any device, at or past the window's end plus the allowed lateness: the one that
moved the partition's stream time, the feature stage's watermark, past it) to
the broker's append time of the window's action (the windows, predictions and action topics are switched to
``LogAppendTime``), not to any processor's clock; the window and prediction of the same reading are
timed the same way, so each hop's share shows. The window length and lateness are the
application's; this is what Tangram adds after them. Needs the stack (``tangram up``)::

    .venv/bin/python benchmarks/bench_latency.py [--max-rate 20000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import CHAIN, HZ, Counts, History, cpu_seconds, fleet, produce, reading_bytes, reference_copy, topics_of  # noqa: E402
from reference_app import Device  # noqa: E402
from report import Figure, emit, load  # noqa: E402
from streams.avro import codec  # noqa: E402
from reference_app import FEATURE_SET  # noqa: E402
from streams.testing import create_topics, partition_of  # noqa: E402
from streams.launcher import Processors  # noqa: E402
from streams.plan import apply  # noqa: E402
from streams.settings import StackSettings  # noqa: E402
from reference_app import load_schema  # noqa: E402
from streams.topology import load_topology  # noqa: E402

WARM_UP_S = 5.0  # windows closed in the first seconds (connections, caches) are not counted


def live_fleet(devices: int, seed: int = 9) -> list[Device]:
    """Devices at 10 Hz: 40 % with wearing bearings and 20 % overheating from the start, the rest healthy."""
    rng = np.random.default_rng(seed)
    faults = ["bearing_wear"] * int(devices * 0.4) + ["overheating"] * int(devices * 0.2)
    return [Device.random(f"dev-{i:05d}", rng, faults[i] if i < len(faults) else "none", 0.0) for i in range(devices)]


class Closers:
    """Per device and window, the send time of the reading that closed the window.

    The feature stage closes a window when its partition's stream time (the newest event time there, of
    any device) reaches the window's end plus the allowed lateness: the closing reading is the first
    reading *of the partition* at or past that point, usually another device's, which comes before the
    device's own. Partitions are the producer's (CRC-32 of the device id, as librdkafka's default
    partitioner; the ingest stage keeps a reading's partition)."""

    def __init__(self, partitions: int) -> None:
        w = FEATURE_SET.window
        self.size, self.hop, self.lateness = w.size_ms, w.hop_ms, w.allowed_lateness_ms
        self.partitions = partitions
        self.partition: dict[str, int] = {}
        self.starts: dict[str, set[int]] = collections.defaultdict(set)  # windows each device opened
        self.open: list[collections.deque[int]] = [collections.deque() for _ in range(partitions)]  # starts, in order
        self.closing: list[dict[int, float]] = [{} for _ in range(partitions)]  # start → send time of its closer
        self.closer: list[dict[int, tuple[str, int]]] = [{} for _ in range(partitions)]  # start → (device, ts)

    def sent(self, device: str, ts: int, at: float) -> None:
        p = self.partition.get(device)
        if p is None:
            p = self.partition[device] = partition_of(device, self.partitions)
        pending = self.open[p]
        while pending and pending[0] + self.size + self.lateness <= ts:
            start = pending.popleft()
            self.closing[p][start], self.closer[p][start] = at, (device, ts)
        base = ts - ts % self.hop
        for start in range(base - self.size + self.hop, base + 1, self.hop):
            if start not in self.closing[p] and (not pending or start > pending[-1]):
                pending.append(start)
            self.starts[device].add(start)

    @property
    def closers(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(device, window start) → (device, event time) of the reading that closed it."""
        return {(device, start): self.closer[self.partition[device]][start]
                for device, starts in self.starts.items() for start in starts
                if start in self.closer[self.partition[device]]}

    @property
    def closed(self) -> dict[tuple[str, int], float]:
        """(device, window start) → the send time of the reading that closed it, for every window closed."""
        return {(device, start): self.closing[self.partition[device]][start]
                for device, starts in self.starts.items() for start in starts
                if start in self.closing[self.partition[device]]}


def send_open_loop(stack: StackSettings, topic: str, devices: list[Device], rate: float, seconds: float,
                   closers: Closers) -> int:
    """Readings at ``rate``/s for ``seconds``, each at its scheduled time (never slowed by the pipeline)."""
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "acks": "all",
                         "linger.ms": 1, "compression.type": "lz4"})
    steps = int(seconds * HZ) + 1
    rng = np.random.default_rng(4)
    samples = [d.sample(np.arange(steps) / HZ, rng) for d in devices]
    total, n = int(rate * seconds), len(devices)
    t0 = time.time() + 0.5
    sent = 0
    while sent < total:
        due = min(total, int((time.time() - t0) * rate) + 1)
        while sent < due:
            device, step = devices[sent % n], sent // n
            now = time.time()
            ts = int(now * 1000)
            producer.produce(topic, reading_bytes(device, ts, samples[sent % n][step]), device.device_id)
            closers.sent(device.device_id, ts, now)
            sent += 1
        producer.poll(0)
        time.sleep(max(0.0, t0 + sent / rate - time.time()))
    if producer.flush(60):
        raise SystemExit("the latency run's readings were not all acknowledged")
    return sent


def broker_times(stack: StackSettings, topic: str, subject: str, key: str) -> dict[tuple[str, int], float]:
    """The broker's append time of the first record of ``topic`` for each (device, ``key``): ``window_start``,
    ``window_end`` (given as its window's start) or ``ts`` (a reading's event time, on the ingest topic)."""
    decoder = codec(stack.registry_url, subject, load_schema(subject))
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"lat-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(3)])
    shift = FEATURE_SET.window.size_ms if key == "window_end" else 0
    out: dict[tuple[str, int], float] = {}
    idle = time.monotonic()
    try:
        while time.monotonic() - idle < 2.0:
            for m in consumer.consume(5000, 0.2):
                if m.error() is None:
                    row = decoder.decode(m.value())
                    out.setdefault((row["device_id"], row[key] - shift), m.timestamp()[1] / 1000)
                    idle = time.monotonic()
    finally:
        consumer.close()
    return out


def hops(closed: dict[tuple[str, int], float], closers: dict[tuple[str, int], tuple[str, int]],
         ingested: dict[tuple[str, int], float], stamped: list[dict[tuple[str, int], float]],
         since: float) -> dict[str, np.ndarray]:
    """Each hop's own share, per window: closing reading sent → ingested → window → prediction → action."""
    names = ("ingest (send → ingested)", "features (ingested → window)", "inference (window → prediction)",
             "rules (prediction → action)")
    out: dict[str, list[float]] = {name: [] for name in names}
    for key, at in closed.items():
        if at < since:
            continue
        times = [at, ingested.get(closers.get(key)), *(s.get(key) for s in stamped)]
        for name, before, after in zip(names, times, times[1:]):
            if before is not None and after is not None:
                out[name].append((after - before) * 1000)
    return {name: np.array(ms) for name, ms in out.items()}


def append_time(stack: StackSettings, topics: list[str]) -> None:
    """Have the broker stamp records of ``topics`` when it appends them (not the producer's clock)."""
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    entry = ConfigEntry("message.timestamp.type", "LogAppendTime", incremental_operation=AlterConfigOpType.SET)
    futures = admin.incremental_alter_configs([ConfigResource(ResourceType.TOPIC, t, incremental_configs=[entry])
                                               for t in topics])
    for future in futures.values():
        future.result(30)


def latencies(closed: dict[tuple[str, int], float], stamped: dict[tuple[str, int], float], since: float) -> np.ndarray:
    return np.array([(stamped[k] - at) * 1000 for k, at in closed.items() if k in stamped and at >= since])


def run_share(stack: StackSettings, rate: float, seconds: float, tag: str) -> dict:
    devices = live_fleet(max(1, round(rate / HZ)))
    prefix = f"lat{tag}r{int(rate)}"
    raw = f"{prefix}.raw.telemetry"
    create_topics(stack.kafka, [raw])
    path = reference_copy(stack, prefix, raw, 1, {"processors/rules/params/cooldown_ms": 0})
    topology = load_topology(path)
    apply(topology, stack)
    topics = topics_of(topology)
    actions = [t for role, t in topics.items() if role.startswith("action:")]
    append_time(stack, [topics["ingested"], topics["windows"], topics["predictions"], *actions])
    closers = Closers(topology.partitions(topics["ingested"]))  # the feature stage's partitions
    counts = Counts(stack)
    with Processors(path, stack, names=list(CHAIN)) as procs:
        procs.start()
        procs.wait_joined(timeout_s=180)
        started = time.time()
        pids = {name: proc.pid for (name, _), proc in procs.procs.items()}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        sent = send_open_loop(stack, raw, devices, rate, seconds, closers)
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 3.0:  # the tail: until the predictions stop growing
            now = counts(topics["predictions"])
            if now != last:
                last, since = now, time.monotonic()
            time.sleep(0.2)
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    counts.close()
    windowed = broker_times(stack, topics["windows"], "pm.features.device_window-value", "window_start")
    predicted = broker_times(stack, topics["predictions"], "pm.predictions.anomaly-value", "window_start")
    acted: dict[tuple[str, int], float] = {}
    for topic in actions:
        subject = topology.topics[topic].schema_
        for k, t in broker_times(stack, topic, subject, "window_end").items():
            acted[k] = min(t, acted.get(k, t))
    since, closed = started + WARM_UP_S, closers.closed
    hop_ms = hops(closed, closers.closers, broker_times(stack, topics["ingested"], "pm.ingest.telemetry-value", "ts"), [windowed, predicted, acted], since)
    return {"rate": rate, "devices": len(devices), "sent": sent, "windows": sum(1 for at in closed.values() if at >= since),
            "hops": hop_ms, "cpu": cpu,
            "window_ms": latencies(closed, windowed, since),
            "prediction_ms": latencies(closed, predicted, since),
            "action_ms": latencies(closed, acted, since)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rate", type=float, help="readings/s the chain sustains; measured first when absent")
    parser.add_argument("--max-rate-from", default="given", help="where --max-rate comes from, for the report")
    parser.add_argument("--catch-up-readings", type=int, default=300_000, help="N of that measurement")
    parser.add_argument("--shares", default="0.1,0.5", help="shares of the maximum rate")
    parser.add_argument("--seconds", type=float, default=30.0, help="sending time per share")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the launched processors on the way out
    stack = StackSettings()
    tag = uuid.uuid4().hex[:6]
    max_rate, how = args.max_rate, args.max_rate_from
    if max_rate is None:
        import bench_e2e
        raw = f"lat{tag}.raw.telemetry"
        create_topics(stack.kafka, [raw])
        history = History(fleet(200), args.catch_up_readings, int(time.time() * 1000))
        produce(stack, raw, history.records())
        run = bench_e2e.tangram(stack, raw, history, 1, f"l{tag}")
        max_rate, how = run.rate, f"catch-up over {history.readings:,} readings in this run"
    print(f"maximum rate {max_rate:,.0f} readings/s ({how}); {load()}", flush=True)
    goals = {0.1: 50.0, 0.5: 100.0}
    for share in [float(s) for s in args.shares.split(",")]:
        result = run_share(stack, share * max_rate, args.seconds, tag)
        win, pred, act = result["window_ms"], result["prediction_ms"], result["action_ms"]
        print(f"\n{share:.0%} of the maximum: {result['rate']:,.0f} readings/s from {result['devices']} devices for "
              f"{args.seconds:g} s ({result['sent']:,} readings, {result['windows']:,} windows closed after the "
              f"{WARM_UP_S:g} s warm-up)")
        for name, ms in (("reading → window", win), ("reading → prediction", pred), ("reading → action", act)):
            if len(ms):
                print(f"  {name:<22} n={len(ms):>6,}  p50 {np.percentile(ms, 50):7.1f} ms  p99 {np.percentile(ms, 99):7.1f} ms"
                      f"  max {ms.max():7.1f} ms")
            else:
                print(f"  {name:<22} none")
        print("  each hop's own share, from the append time of the record before it (the closing reading's send first):")
        for name, ms in result["hops"].items():
            if len(ms):
                print(f"    {name:<32} p50 {np.percentile(ms, 50):7.1f} ms  p99 {np.percentile(ms, 99):7.1f} ms")
        print("  CPU seconds of each processor over the share (sending and the tail): "
              + ", ".join(f"{name} {s:.2f}" for name, s in result["cpu"].items()))
        goal = goals.get(round(share, 2))
        if len(act):
            emit(Figure(f"reading → action p99 at {share:.0%} of the maximum rate ({result['rate']:,.0f} readings/s, "
                        "open loop; from the closing reading's send to the action's broker append time)",
                        f"p99 {np.percentile(act, 99):.1f} ms, p50 {np.percentile(act, 50):.1f} ms over {len(act):,} "
                        f"actions (reading → prediction p99 {np.percentile(pred, 99):.1f} ms)",
                        f"max rate {max_rate:,.0f}/s ({how})",
                        f"goal p99 ≤ {goal:g} ms" if goal else "", n=result["sent"], batch="per topology (linger 5 ms)",
                        benchmark="bench_latency"))


if __name__ == "__main__":
    main()
