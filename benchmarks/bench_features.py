"""Feature engines and online reads, measured against baselines in the same run (figures, not tests).

Needs a running stack (`tangram up`, or TANGRAM_* variables pointing at one) and the Flink env.

    .venv/bin/python benchmarks/bench_features.py [--devices 100] [--seconds 60]

Prints:
- events/s through the embedded engine, the Faust job and the PyFlink job (local mini-cluster),
  each as a ratio to a raw confluent-kafka consume of the same records;
- online-store read latency p50/p99 and QPS at 1, 10 and 100 keys per call;
- memory of the embedded engine's state per 10k devices with half-full windows.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import numpy as np
import redis
from confluent_kafka import Consumer, TopicPartition

from streams import PROJECT_ROOT
from streams.avro import codec
from streams.features import FEATURE_SET, EntityWindows, faust_job
from streams.features.online import OnlineWriter, online_prefix, read_online_features
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
                             redis_url=stack.redis_url, prefix=f"tangram:{prefix}:faust", source=source,
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
                        output=output + "_flink", bounded=True)
        t0 = time.monotonic()
        run_job(argv, timeout_s=900, log_path=tmp / f"flink-{count}.log")
        timings.append((count, time.monotonic() - t0))
    (n0, w0), (n1, w1) = timings
    rate, marginal = n1 / w1, (n1 - n0) / max(w1 - w0, 1e-9)
    print(f"  PyFlink job (mini-cluster, {w0:.0f}s fixed cost) {rate:>10,.0f} events/s    {rate / raw:.3f}×"
          f"   (marginal, start excluded: {marginal:,.0f}/s, {marginal / raw:.3f}×)")


def online_reads(stack: StackSettings, devices: int = 10_000, seconds_each: float = 2.0) -> None:
    prefix = online_prefix(f"bench{uuid.uuid4().hex[:6]}", "features")
    writer = OnlineWriter(stack.redis_url, prefix, FEATURE_SET)
    names = FEATURE_SET.feature_names
    for i in range(devices):
        writer.stage({"device_id": f"dev-{i:05d}", "window_start": 0, "window_end": 5000, "count": 50,
                      **{name: float(i) for name in names}})
    writer.flush()
    writer.close()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    rng = np.random.default_rng(0)
    print(f"online reads ({devices:,} devices in Redis, one client, closed loop, read_online_features):")
    for keys in (1, 10, 100):
        lat = []
        deadline = time.perf_counter() + seconds_each
        while time.perf_counter() < deadline:
            ids = [f"dev-{i:05d}" for i in rng.integers(0, devices, keys)]
            t0 = time.perf_counter()
            read_online_features(client, ids, prefix)
            lat.append(time.perf_counter() - t0)
        ms = np.array(lat) * 1000
        qps = len(lat) / ms.sum() * 1000
        print(f"  {keys:>3} keys/call  p50 {np.percentile(ms, 50):6.3f} ms  p99 {np.percentile(ms, 99):6.3f} ms  "
              f"{qps:>8,.0f} calls/s  {qps * keys:>9,.0f} keys/s")
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


def _open_loop_worker(args: tuple[str, str, int, float, float, int, int, float]) -> list[float]:
    """One reader process: calls at ``rate``/s from ``start`` (wall clock); latency from each scheduled time."""
    url, prefix, devices, rate, seconds, keys, seed, start = args
    client = redis.Redis.from_url(url, socket_timeout=5)
    rng = np.random.default_rng(seed)
    latencies = []
    for k in range(int(rate * seconds)):
        scheduled = start + k / rate
        if (delay := scheduled - time.time()) > 0:
            time.sleep(delay)
        read_online_features(client, [f"dev-{i:05d}" for i in rng.integers(0, devices, keys)], prefix)
        latencies.append(time.time() - scheduled)
    client.close()
    return latencies


def online_reads_open_loop(stack: StackSettings, rate: float = 10_000, seconds: float = 5.0,
                           devices: int = 10_000, processes: int = 4) -> None:
    """Open loop at a fixed total rate from several reader processes (as several rule-processor replicas
    would read): each call's latency runs from its scheduled time, so queueing behind a slow call counts."""
    from multiprocessing import Pool

    prefix = online_prefix(f"bench{uuid.uuid4().hex[:6]}", "features")
    writer = OnlineWriter(stack.redis_url, prefix, FEATURE_SET)
    for i in range(devices):
        writer.stage({"device_id": f"dev-{i:05d}", "window_start": 0, "window_end": 5000, "count": 50,
                      **{name: float(i) for name in FEATURE_SET.feature_names}})
    writer.flush()
    writer.close()
    print(f"online reads, open loop at {rate:,.0f} calls/s in all from {processes} processes for {seconds:g}s "
          f"({devices:,} devices in Redis, read_online_features):")
    for keys in (1, 10):
        start = time.time() + 1.0
        jobs = [(stack.redis_url, prefix, devices, rate / processes, seconds, keys, p, start) for p in range(processes)]
        with Pool(processes) as pool:
            ms = np.concatenate([np.array(x) for x in pool.map(_open_loop_worker, jobs)]) * 1000
        achieved = len(ms) / (seconds + ms.max() / 1000)
        print(f"  {keys:>3} keys/call  {len(ms):,} calls (about {achieved:,.0f}/s)  p50 {np.percentile(ms, 50):6.3f} ms  "
              f"p99 {np.percentile(ms, 99):6.3f} ms  (from the scheduled send time)")
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


def memory_per_10k_devices() -> None:
    """The embedded engine's state: one open window per device, half full (25 readings)."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=100)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--reads-only", action="store_true", help="Only the online-read measurements.")
    args = p.parse_args()
    stack = StackSettings()
    if not args.reads_only:
        engines(stack, args.devices, args.seconds)
    online_reads(stack)
    online_reads_open_loop(stack)
    if not args.reads_only:
        memory_per_10k_devices()


if __name__ == "__main__":
    main()
