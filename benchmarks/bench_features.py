"""Feature engines and online reads, measured against baselines in the same run (figures, not tests).

Needs a running stack (`tangram up`, or TANGRAM_* variables pointing at one) and the Flink env.

    .venv/bin/python benchmarks/bench_features.py [--devices 100] [--seconds 60]

Prints:
- events/s through the embedded engine, the Faust job and the PyFlink job (local mini-cluster),
  each as a ratio to a raw confluent-kafka consume of the same records;
- online-store reads (Feast's Redis layout) at 1, 10 and 100 keys per call: one client closed loop,
  then open loop at fixed rates (latency from each call's scheduled time), the blocking reader
  (``read_online_features`` from several processes, the baseline) beside ``OnlineLookup``;
- memory per 10k devices with half-full windows: the Faust job's own process (RSS growth of the
  worker from start-up with no devices to 10,000 devices' state), beside the embedded engine's state
  (tracemalloc).

    .venv/bin/python benchmarks/bench_features.py --memory-only   # only the memory figures
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
from confluent_kafka import Consumer, ConsumerGroupState, TopicPartition
from confluent_kafka.admin import AdminClient

from streams import PROJECT_ROOT
from streams.avro import codec
from streams.features import FEATURE_SET, EntityWindows, faust_job
from streams.features.layout import FeastLayout
from streams.features.online import OnlineLookup, OnlineWriter, read_online_features
from streams.features.testing import count_records, create_topics, produce_readings, recorded_readings
from streams.flink.launcher import job_argv, run_job
from streams.plan import apply
from streams.run import make_runner
from streams.settings import StackSettings
from streams.topology import load_schema, load_topology

TOPOLOGY = PROJECT_ROOT / "topologies" / "predictive_maintenance.yaml"


def isolated(tmp: Path) -> tuple[Path, str]:
    prefix = f"b{uuid.uuid4().hex[:8]}"
    text = re.sub(r"\bpm\.(raw|ingest|features|predictions|actions|dlq|sim)\.([a-z_]+)\b(?!-value)",
                  lambda m: f"{prefix}.{m.group(1)}.{m.group(2)}", TOPOLOGY.read_text())
    path = tmp / f"{prefix}.yaml"
    path.write_text(re.sub(r"^app: pm$", f"app: {prefix}", text, flags=re.MULTILINE))
    return path, prefix


def wait_count(stack: StackSettings, topic: str, n: int, timeout_s: float = 600) -> float:
    deadline = time.monotonic() + timeout_s
    while count_records(stack.bootstrap_servers, topic) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{topic}: fewer than {n} records after {timeout_s}s")
        time.sleep(0.05)
    return time.monotonic()


def raw_consume(stack: StackSettings, topic: str, n: int) -> float:
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"raw-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(3)])
    got, t0 = 0, time.perf_counter()
    while got < n:
        got += sum(1 for m in consumer.consume(1000, 1.0) if not m.error())
    elapsed = time.perf_counter() - t0
    consumer.close()
    return n / elapsed


def engines(stack: StackSettings, devices: int, seconds: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-features-"))
    path, prefix = isolated(tmp)
    topology = load_topology(path)
    apply(topology, stack)
    source, output = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window"
    extra = [output + "_faust", output + "_flink", f"{prefix}.dlq.faust", f"{prefix}.dlq.flink", f"{prefix}.ingest.small"]
    create_topics(stack.bootstrap_servers, extra)
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    readings = recorded_readings(devices, seconds, late_every=10**9, straggle_every=10**9)
    produce_readings(stack.bootstrap_servers, source, in_codec, readings)
    windows = devices * (int(seconds * 1000) // FEATURE_SET.window.size_ms - 1)
    n = len(readings)
    print(f"input: {n:,} readings of {devices} devices over {seconds:.0f}s of event time → {windows:,} windows")

    raw = raw_consume(stack, source, n)
    print(f"  raw consume (confluent-kafka, no decode)     {raw:>10,.0f} records/s   1.00×")

    runner = make_runner(topology, "features", stack)
    thread = threading.Thread(target=runner.run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    t1 = wait_count(stack, output, windows)
    runner.stop()
    thread.join(30)
    rate = n / (t1 - t0)
    print(f"  embedded engine (delivery loop)            {rate:>10,.0f} events/s    {rate / raw:.3f}×")

    argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                             redis_url=stack.redis_url, project=f"{prefix}-faust", source=source,
                             output=output + "_faust", dlq=f"{prefix}.dlq.faust", group=f"{prefix}.faust")
    t0 = time.monotonic()
    worker = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=(tmp / "faust.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        first = wait_count(stack, output + "_faust", 1)
        t1 = wait_count(stack, output + "_faust", windows)
    finally:
        worker.terminate()
        worker.wait(30)
    rate, steady = n / (t1 - t0), n / max(t1 - first, 1e-9)
    print(f"  Faust job (incl. {first - t0:.1f}s start)          {rate:>10,.0f} events/s    {rate / raw:.3f}×"
          f"   (after first output: {steady:,.0f}/s, {steady / raw:.3f}×)")

    small = recorded_readings(1, 10.0, late_every=10**9, straggle_every=10**9)
    produce_readings(stack.bootstrap_servers, f"{prefix}.ingest.small", in_codec, small)
    timings = []
    for src, count in ((f"{prefix}.ingest.small", len(small)), (source, n)):
        argv = job_argv(stack, dlq=f"{prefix}.dlq.flink", group=f"{prefix}.flink-{count}", source=src,
                        output=output + "_flink", bounded=True, online_project=f"{prefix}-flink")
        t0 = time.monotonic()
        run_job(argv, timeout_s=900, log_path=tmp / f"flink-{count}.log")
        timings.append((count, time.monotonic() - t0))
    (n0, w0), (n1, w1) = timings
    rate, marginal = n1 / w1, (n1 - n0) / max(w1 - w0, 1e-9)
    print(f"  PyFlink job (mini-cluster, {w0:.0f}s fixed cost) {rate:>10,.0f} events/s    {rate / raw:.3f}×"
          f"   (marginal, start excluded: {marginal:,.0f}/s, {marginal / raw:.3f}×)")


def _fill_online_store(stack: StackSettings, devices: int) -> FeastLayout:
    """``devices`` rows in Feast's Redis layout under a fresh project, as the engines write them."""
    layout = FeastLayout.of(FEATURE_SET, f"bench{uuid.uuid4().hex[:6]}")
    writer = OnlineWriter(stack.redis_url, layout)
    for i in range(devices):
        writer.stage({"device_id": f"dev-{i:05d}", "window_start": 0, "window_end": 5000, "count": 50,
                      **{name: float(i) for name in FEATURE_SET.feature_names}})
    writer.flush()
    writer.close()
    return layout


def _drop_project(stack: StackSettings, layout: FeastLayout, devices: int) -> None:
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    keys = [layout.key(f"dev-{i:05d}") for i in range(devices)]
    for at in range(0, len(keys), 1000):
        client.delete(*keys[at:at + 1000])
    client.close()


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def online_reads(stack: StackSettings, layout: FeastLayout, devices: int, seconds_each: float = 2.0) -> None:
    """One client, closed loop: the cost of one call of ``read_online_features`` with nothing else running."""
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    rng = np.random.default_rng(0)
    print(f"online reads, one client, closed loop ({devices:,} devices in Feast's layout, read_online_features):")
    for keys in (1, 10, 100):
        lat = []
        deadline = time.perf_counter() + seconds_each
        while time.perf_counter() < deadline:
            ids = [f"dev-{i:05d}" for i in rng.integers(0, devices, keys)]
            t0 = time.perf_counter()
            read_online_features(client, ids, layout)
            lat.append(time.perf_counter() - t0)
        ms = np.array(lat) * 1000
        qps = len(lat) / ms.sum() * 1000
        print(f"  {keys:>3} keys/call  p50 {np.percentile(ms, 50):6.3f} ms  p99 {np.percentile(ms, 99):6.3f} ms  "
              f"{qps:>8,.0f} calls/s  {qps * keys:>9,.0f} keys/s")
    client.close()


@dataclass(frozen=True)
class OpenLoop:
    """One open-loop run: ``rate`` calls/s in all, ``keys`` keys a call, for ``seconds``, from ``processes``."""

    url: str
    layout: FeastLayout
    devices: int
    rate: float
    seconds: float
    keys: int
    processes: int
    start: float  # wall clock of the first scheduled call

    def calls(self, seed: int) -> list[list[str]]:
        rng = np.random.default_rng(seed)
        n = int(self.rate / self.processes * self.seconds)
        return [[f"dev-{i:05d}" for i in rng.integers(0, self.devices, self.keys)] for _ in range(n)]


def _sync_reader(job: tuple[OpenLoop, int]) -> tuple[np.ndarray, float]:
    """Baseline reader process: one call at a time with ``read_online_features`` (blocking client)."""
    run, seed = job
    client = redis.Redis.from_url(run.url, socket_timeout=5)
    calls, rate = run.calls(seed), run.rate / run.processes
    latencies = np.empty(len(calls))
    for k, ids in enumerate(calls):
        scheduled = run.start + k / rate
        if (delay := scheduled - time.time()) > 0:
            time.sleep(delay)
        read_online_features(client, ids, run.layout)
        latencies[k] = time.time() - scheduled
    client.close()
    return latencies, time.time()


def _async_reader(job: tuple[OpenLoop, int]) -> tuple[np.ndarray, float, int]:
    """Reader process serving its callers with one ``OnlineLookup``: each call a task started at its
    scheduled time (later if the loop is busy: that delay counts), lookups coalesced into round trips."""
    run, seed = job

    async def main() -> tuple[np.ndarray, float, int]:
        lookup = OnlineLookup(run.url, run.layout)
        await lookup.get(["dev-00000"])  # connect and load the script before the clock starts
        loop = asyncio.get_running_loop()
        calls, rate = run.calls(seed), run.rate / run.processes
        latencies = np.full(len(calls), np.nan)
        start = loop.time() + (run.start - time.time())
        pending: set[asyncio.Task] = set()

        async def call(k: int, scheduled: float) -> None:
            await lookup.get(calls[k])
            latencies[k] = loop.time() - scheduled

        k = 0
        while k < len(calls):
            due = min(len(calls), int((loop.time() - start) * rate) + 1)
            while k < due:
                task = asyncio.create_task(call(k, start + k / rate))
                pending.add(task)
                task.add_done_callback(pending.discard)
                k += 1
            await asyncio.sleep(max(0.0, start + k / rate - loop.time()))
        if pending:
            await asyncio.gather(*pending)
        trips = lookup.round_trips
        await lookup.close()
        return latencies, time.time(), trips

    return asyncio.run(main())


def online_reads_open_loop(stack: StackSettings, layout: FeastLayout, devices: int, seconds: float = 5.0,
                           baseline_processes: int = 4, lookup_processes: int = 1) -> None:
    """Open loop at fixed rates: every call has a scheduled send time and its latency runs from there,
    so a call queued behind a slow one counts (no coordinated omission)."""
    from multiprocessing import Pool

    print(f"online reads, open loop, {seconds:g} s a run ({devices:,} devices in Feast's layout; {_load()}):")
    print("  reader                                   keys  target/s  achieved/s  keys/s     p50 ms    p99 ms   p99.9 ms")
    plan = [(1, 10_000), (10, 10_000), (10, 1_000), (100, 1_000), (100, 100)]
    readers = [("baseline: read_online_features, blocking", _sync_reader, baseline_processes),
               ("OnlineLookup (asyncio, coalescing)", _async_reader, lookup_processes)]
    for keys, rate in plan:
        baseline_p99 = None
        for name, reader, processes in readers:
            run = OpenLoop(stack.redis_url, layout, devices, rate, seconds, keys, processes, time.time() + 1.5)
            with Pool(processes) as pool:
                results = pool.map(reader, [(run, seed) for seed in range(processes)])
            ms = np.concatenate([r[0] for r in results]) * 1000
            took = max(r[1] for r in results) - run.start
            achieved = len(ms) / took
            p99 = np.percentile(ms, 99)
            extra = ""
            if baseline_p99 is None:
                baseline_p99 = p99
            else:
                extra = f"  p99 {p99 / baseline_p99:.2f}× the baseline's, {sum(r[2] for r in results):,} round trips"
            label = f"{name}, {processes} proc"
            print(f"  {label:<40} {keys:>4} {rate:>9,.0f} {achieved:>11,.0f} {achieved * keys:>8,.0f}  "
                  f"{np.percentile(ms, 50):8.3f}  {p99:8.3f}  {np.percentile(ms, 99.9):9.3f}{extra}", flush=True)
    print(f"  (after the runs: {_load()})")


def memory_per_10k_devices() -> int:
    """The embedded engine's state: one open window per device, half full (25 readings); returns its bytes."""
    rng = np.random.default_rng(1)
    rows = [list(rng.normal(10, 2, len(FEATURE_SET.inputs))) for _ in range(25)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    states = {}
    for d in range(10_000):
        state = states[f"dev-{d:05d}"] = EntityWindows(FEATURE_SET)
        for i, row in enumerate(rows):
            state.add(1_000_000 + i * 100, list(row), (None, i), None)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(s.size_diff for s in after.compare_to(before, "filename"))
    print(f"embedded engine state: {size / 2**20:.1f} MiB per 10k devices (one half-full 5 s window each, "
          f"{size / 10_000 / 25:.0f} B per buffered reading)")
    return size


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from ``/proc/<pid>/status``: resident now, and its peak."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _wait_member(stack: StackSettings, group: str, worker: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the Faust worker's consumer group is stable with partitions assigned (the worker is up)."""
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the Faust worker exited with {worker.returncode} during start-up")
        desc = admin.describe_consumer_groups([group])[group].result(10)
        if desc.state == ConsumerGroupState.STABLE and any(m.assignment.topic_partitions for m in desc.members):
            return
        time.sleep(0.5)
    raise SystemExit(f"consumer group {group}: no stable member after {timeout_s}s")


def _wait_consumed(stack: StackSettings, group: str, topic: str, changelog: str, n: int,
                   worker: subprocess.Popen, timeout_s: float = 900) -> float:
    """Until ``group`` has committed every offset of ``topic`` (lag 0, ``n`` records in all) and the table's
    changelog holds ``n`` records (one table write per reading applied); returns the seconds it took."""
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": group,
                         "enable.auto.commit": False})  # reads the group's committed offsets; never joins it
    tps = [TopicPartition(topic, p) for p in range(3)]
    t0 = time.monotonic()
    try:
        while True:
            if worker.poll() is not None:
                raise SystemExit(f"the Faust worker exited with {worker.returncode}")
            ends = [consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps]
            committed = [max(tp.offset, 0) for tp in consumer.committed(tps, timeout=10)]
            lag = sum(e - c for e, c in zip(ends, committed, strict=True))
            if sum(ends) == n and lag == 0 and count_records(stack.bootstrap_servers, changelog) >= n:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"{group}: lag {lag} on {topic} after {timeout_s}s")
            time.sleep(0.5)
    finally:
        consumer.close()


def faust_memory_per_10k_devices(stack: StackSettings, devices: int = 10_000, settle_s: float = 5.0) -> float:
    """The Faust job's own process: RSS after start-up with no devices, then after ``devices`` devices' state
    (half-full 5 s windows: 25 readings each at 10 Hz, none closed) is built, in two halves; returns MiB per 10k.

    The worker runs as its own process, as in production and in the parity test; RSS is read from /proc only
    once its consumer group has committed every reading and its table's changelog holds one write per reading.
    The growth from start-up includes one-off costs of the first records (buffers, codecs, the producer); the
    growth between the halves is the marginal cost of state alone (RSS rarely shrinks: a high-water mark).
    """
    tmp = Path(tempfile.mkdtemp(prefix="bench-faust-memory-"))
    path, prefix = isolated(tmp)
    apply(load_topology(path), stack)
    source, output, dlq, group = (f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window",
                                  f"{prefix}.dlq.features", f"{prefix}.faust-memory")
    changelog = f"{group}-entity_windows-changelog"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    size_s = FEATURE_SET.window.size_ms / 1000
    readings = recorded_readings(devices, size_s / 2, hz=FEATURE_SET.sample_hz, late_every=10**9,
                                 straggle_every=10**9)
    per_device = len(readings) // devices
    half = {f"dev-{i:05d}" for i in range(devices // 2)}
    halves = [[r for r in readings if r["device_id"] in half], [r for r in readings if r["device_id"] not in half]]
    argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                             redis_url=stack.redis_url, project=f"{prefix}-faust", source=source, output=output,
                             dlq=dlq, group=group)
    worker = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=(tmp / "faust.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_member(stack, group, worker)
        time.sleep(settle_s)
        rss = [_rss_kib(worker.pid)]
        fed, took = 0, []
        for part in halves:
            produce_readings(stack.bootstrap_servers, source, in_codec, part)
            fed += len(part)
            took.append(_wait_consumed(stack, group, source, changelog, fed, worker))
            time.sleep(settle_s)
            rss.append(_rss_kib(worker.pid))
    finally:
        worker.terminate()
        worker.wait(30)
    emitted, late = count_records(stack.bootstrap_servers, output), count_records(stack.bootstrap_servers, dlq)
    if emitted or late:
        raise SystemExit(f"expected only open windows: {emitted} windows emitted, {late} readings in the DLQ")
    (start, _), (mid, _), (end, peak) = rss
    mib = 1024
    growth = (end - start) / mib * 10_000 / devices
    marginal = (end - mid) / mib * 10_000 / (devices - devices // 2)
    print(f"Faust job memory (streams.features.faust_job, own process; {devices:,} devices × {per_device} readings = "
          f"one half-full {size_s:g} s window each; RSS from /proc/<pid>/status after lag 0 and {settle_s:g} s idle):")
    rows = [("RSS after start-up, no devices", start, ""),
            (f"RSS after {devices // 2:,} devices' state", mid, f"   (consumed in {took[0]:.1f} s)"),
            (f"RSS after {devices:,} devices' state", end,
             f"   (consumed in {took[1]:.1f} s; peak VmHWM {peak / mib:.1f} MiB)"),
            ("growth per 10k devices", growth * mib, f"   (start-up → {devices:,}; marginal, second half only: "
                                                     f"{marginal:.1f} MiB per 10k)")]
    for label, kib, note in rows:
        print(f"  {label:<36}{kib / mib:8.1f} MiB{note}")
    return growth


def memory(stack: StackSettings) -> None:
    """The Faust job's RSS growth per 10k devices, and the embedded engine's state beside it."""
    faust = faust_memory_per_10k_devices(stack)
    embedded = memory_per_10k_devices() / 2**20
    print(f"memory per 10k devices, half-full windows: Faust job {faust:.1f} MiB (process RSS growth), "
          f"embedded engine {embedded:.1f} MiB (state objects, tracemalloc); Faust / embedded {faust / embedded:.2f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=100)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--reads-only", action="store_true", help="Only the online-read measurements.")
    p.add_argument("--online-devices", type=int, default=10_000, help="Entities in the online store for the reads.")
    p.add_argument("--baseline-processes", type=int, default=4, help="Blocking reader processes (baseline).")
    p.add_argument("--lookup-processes", type=int, default=1, help="OnlineLookup reader processes.")
    p.add_argument("--memory-only", action="store_true", help="Only the memory per 10k devices (Faust job, embedded).")
    args = p.parse_args()
    stack = StackSettings()
    if args.memory_only:
        memory(stack)
        return
    if not args.reads_only:
        engines(stack, args.devices, args.seconds)
    layout = _fill_online_store(stack, args.online_devices)
    try:
        online_reads(stack, layout, args.online_devices)
        online_reads_open_loop(stack, layout, args.online_devices, baseline_processes=args.baseline_processes,
                               lookup_processes=args.lookup_processes)
    finally:
        _drop_project(stack, layout, args.online_devices)
    if not args.reads_only:
        memory(stack)


if __name__ == "__main__":
    main()
