"""Feature engines and online reads, measured against baselines in the same run (figures, not tests).

Needs a running stack (`tangram up`, or TANGRAM_* variables pointing at one); ``--flink`` needs the
Flink environment (``.venv-flink``) and Maven for the job's jars.

    .venv/bin/python benchmarks/bench_features.py [--devices 200] [--seconds 250] [--faust] [--flink]

Prints:
- the embedded engine (the ``features`` processor in its at-least-once delivery loop: decode, windows,
  features, encode, Feast's Redis layout) over N readings (default 200 devices × 250 s at 10 Hz =
  500,000), in readings/s and CPU µs per reading, beside the **raw confluent-kafka loop** doing the same
  Kafka work on the same records (``baselines.py``: read every reading, write one record per window's
  worth of readings, acks, commit; run before and after the engine, the ratio taken to their mean). Both
  clocks start at the first record consumed, in this process, and count the windows emitted;
- ``--faust``: the Faust job on the same records, timed from outside from its first window out to its
  last over the readings consumed between (start-up and group joins count for nothing), windows counted;
- ``--flink``: the Flink SQL job (bounded, local mini-cluster) at parallelism 1 and 2 on the same records,
  timed as the Faust job is (its start, planner and Python workers count for nothing), windows counted,
  with the CPU its processes (client, JVM, Python workers) used over the same span: µs a reading, cores
  busy, and readings/s a slot;
- online-store reads (Feast's Redis layout) at 1, 10 and 100 keys per call: closed loop with 1 and 4
  concurrent clients (calls completed over wall time), then open loop at fixed rates (latency from
  each call's scheduled time), the blocking reader (``read_online_features`` from several processes,
  the baseline) beside ``OnlineLookup``;
- memory per 10k devices with half-full windows, one measure for both: the RSS growth of the Faust
  job's own process and of the embedded engine's own process (``tangram run … features``).

    .venv/bin/python benchmarks/bench_features.py --engines-only   # only the engines
    .venv/bin/python benchmarks/bench_features.py --memory-only    # only the memory figures
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import redis
from confluent_kafka import Consumer, ConsumerGroupState, TopicPartition
from confluent_kafka.admin import AdminClient

from streams.avro import codec
from streams.features import faust_job
from streams.features.layout import FeastLayout
from streams.features.online import OnlineLookup, OnlineWriter, read_online_features
from streams.namespace import namespaced
from streams.testing import count_records, create_topics, produce_records
from streams.flink.launcher import job_argv, run_job
from streams.launcher import Processors
from streams.plan import apply
from streams.run import make_runner
from streams.settings import StackSettings
from streams.topology import Topology, load_topology

from baselines import raw_copy_seconds
from reference_app import FEATURE_SET, FEATURE_SET_FILE, REPO, TOPOLOGY, load_schema, recorded_readings
from report import Figure, emit, scratch


def isolated(tmp: Path) -> tuple[Path, str]:
    """The reference topology under a fresh namespace (its topics, groups and online keys its own)."""
    prefix = f"b{uuid.uuid4().hex[:8]}"
    return namespaced(TOPOLOGY, prefix, tmp / f"{prefix}.yaml"), prefix


def wait_count(stack: StackSettings, topic: str, n: int, timeout_s: float = 900, alive=lambda: True) -> float:
    """Until ``topic`` holds ``n`` records; returns the wall time that was first seen (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while count_records(stack.kafka, topic) < n:
        if time.monotonic() > deadline or not alive():
            raise SystemExit(f"{topic}: fewer than {n} records after {timeout_s}s" if alive() else
                             f"{topic}: the job writing it stopped before {n} records")
        time.sleep(0.05)
    return time.time()


class JobCPU:
    """The CPU seconds (user + system) of the Flink job's processes: this process's child running
    ``streams.flink.job`` (the client and the mini-cluster's JVM it starts) and every descendant (the Python UDF
    workers), read from /proc when asked and every 100 ms meanwhile, so that a process that exits keeps its
    last reading."""

    def __init__(self) -> None:
        self._seen: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, daemon=True)

    def __enter__(self) -> "JobCPU":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _keep(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def sample(self) -> dict[int, float]:
        """Read every process of the job now; the CPU seconds of each process seen so far, by pid."""
        with self._lock:
            for child in psutil.Process().children():
                try:
                    if any("streams.flink.job" in part for part in child.cmdline()):
                        for proc in (child, *child.children(recursive=True)):
                            times = proc.cpu_times()
                            self._seen[proc.pid] = times.user + times.system
                except psutil.NoSuchProcess:
                    continue
            return dict(self._seen)


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two ``JobCPU.sample`` readings (a process started between counts from zero)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


@dataclass(frozen=True)
class Run:
    rate: float  # readings/s from the first record consumed
    cpu_us: float  # CPU µs of this process per reading (the loop runs in it)


def raw_loop(stack: StackSettings, source: str, sink: str, n: int, batch: int, every: int) -> Run:
    """The raw loop over the ``n`` readings, one record out per ``every`` read: its rate and CPU per reading."""
    cpu = time.process_time()
    seconds = raw_copy_seconds(stack, source, sink, n, batch, every=every)
    return Run(n / seconds, (time.process_time() - cpu) / n * 1e6)


def embedded(topology: Topology, stack: StackSettings, n: int) -> tuple[Run, int]:
    """The features processor in its delivery loop, in this process, until it has read ``n`` readings: its rate
    and CPU per reading from the first batch, and the windows it emitted."""
    runner = make_runner(topology, "features", stack)
    runner.freeze_heap = True  # the stage timed as `tangram run` runs it
    process, state = runner.processor.process, {"done": 0, "started": None, "cpu": 0.0, "windows": 0}

    def counted(batch):
        if state["started"] is None:
            state["started"], state["cpu"] = time.perf_counter(), time.process_time()
        out = process(batch)
        state["done"] += len(batch)
        state["windows"] += sum(1 for o in out if o.topic == runner.processor.output_topic)
        if state["done"] >= n:
            runner.stop()
        return out

    runner.processor.process = counted
    runner.run()  # returns after the batch that reached n was delivered, flushed to Redis and committed
    seconds, cpu = time.perf_counter() - state["started"], time.process_time() - state["cpu"]
    return Run(n / seconds, cpu / n * 1e6), state["windows"]


def readings_after_first_close(readings: list[dict]) -> int:
    """Readings at or past the event time that closes the first window (from then on windows flow out)."""
    w = FEATURE_SET.window
    first = min(r["ts"] for r in readings)
    closes = first - first % w.hop_ms + w.size_ms + w.allowed_lateness_ms
    return sum(1 for r in readings if r["ts"] >= closes)


def engines(stack: StackSettings, devices: int, seconds: float, faust: bool, flink: bool) -> None:
    with scratch("bench-features-") as tmp:
        _engines(tmp, stack, devices, seconds, faust, flink)


def _engines(tmp: Path, stack: StackSettings, devices: int, seconds: float, faust: bool, flink: bool) -> None:
    path, prefix = isolated(tmp)
    topology = load_topology(path)
    apply(topology, stack)
    source, output = f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window"
    create_topics(stack.kafka, [output + "_faust", f"{prefix}.dlq.faust", f"{prefix}.dlq.flink", f"{prefix}.raw_reduce"])
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    readings = recorded_readings(devices, seconds, late_every=10**9, straggle_every=10**9)
    produce_records(stack.kafka, source, in_codec, readings, key="device_id")
    windows = devices * (int(seconds * 1000) // FEATURE_SET.window.size_ms - 1)
    n, batch = len(readings), topology.processors["features"].batch_size
    per_window = n // windows
    print(f"input: {n:,} readings of {devices} devices over {seconds:.0f} s of event time → {windows:,} windows; "
          f"batch size {batch}; {_load()}")

    before = raw_loop(stack, source, f"{prefix}.raw_reduce", n, batch, per_window)
    engine, emitted = embedded(topology, stack, n)
    after = raw_loop(stack, source, f"{prefix}.raw_reduce", n, batch, per_window)
    raw = (before.rate + after.rate) / 2
    print(f"  raw loop: consume → one record per {per_window} read → acks → commit   {raw:>10,.0f} readings/s   1.00×   "
          f"{before.cpu_us:5.2f} µs CPU/reading   (before {before.rate:,.0f}/s, after {after.rate:,.0f}/s)")
    print(f"  embedded engine (delivery loop, also writing Feast's store)      {engine.rate:>10,.0f} readings/s   "
          f"{engine.rate / raw:.3f}×   {engine.cpu_us:5.2f} µs CPU/reading   ({emitted:,} windows out)")
    if emitted != windows:
        raise SystemExit(f"the embedded engine emitted {emitted:,} windows, not {windows:,}")
    baseline = f"raw loop, one record out per {per_window} read, {raw:,.0f}/s (mean of before and after)"
    emit(Figure("feature windows: embedded engine (delivery loop, also writing Feast's store)",
                f"{engine.rate:,.0f} readings/s, {engine.cpu_us:.1f} µs CPU/reading ({emitted:,} windows out of "
                f"{windows:,})", baseline, f"{engine.rate / raw:.3f} (goal ≥ 0.5)", n=n, batch=batch,
                benchmark="bench_features", value=engine.rate))

    if faust:
        timed_n = readings_after_first_close(readings)
        argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                                 redis_url=stack.redis_url, project=f"{prefix}-faust", source=source,
                                 output=output + "_faust", dlq=f"{prefix}.dlq.faust", group=f"{prefix}.faust",
                                 feature_set=str(FEATURE_SET_FILE), table=f"{prefix}.devices")
        worker = subprocess.Popen(argv, cwd=REPO, stdout=(tmp / "faust.log").open("wb"), stderr=subprocess.STDOUT)
        try:
            first = wait_count(stack, output + "_faust", 1)
            last = wait_count(stack, output + "_faust", windows, timeout_s=3600)  # ~1.4k readings/s: 500k in ~6 min
        finally:
            worker.terminate()
            worker.wait(30)
        rate, got = timed_n / max(last - first, 1e-9), count_records(stack.kafka, output + "_faust")
        print(f"  Faust job (first window out → last, over the {timed_n:,} readings between)   {rate:>10,.0f} readings/s   "
              f"{rate / raw:.3f}×   ({got:,} windows out)")
        emit(Figure("feature windows: Faust job", f"{rate:,.0f} readings/s ({got:,} windows out of {windows:,})",
                    baseline, f"{rate / raw:.3f}", n=n, batch="-", benchmark="bench_features"))

    if flink:
        timed_n = readings_after_first_close(readings)
        single = None
        for parallelism in (1, 2):
            out = f"{output}_flink{parallelism}"
            create_topics(stack.kafka, [out])
            argv = job_argv(stack, feature_set=str(FEATURE_SET_FILE), dlq=f"{prefix}.dlq.flink",
                            group=f"{prefix}.flink{parallelism}", source=source, output=out,
                            table=f"{prefix}.devices", bounded=True,
                            online_project=f"{prefix}-flink", parallelism=parallelism)
            failed: list[BaseException] = []

            def job(argv=argv, parallelism=parallelism) -> None:
                try:
                    run_job(argv, timeout_s=1800, log_path=tmp / f"flink-{parallelism}.log", settings=stack)
                except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
                    failed.append(exc)

            started = time.time()
            thread = threading.Thread(target=job, daemon=True)
            with JobCPU() as cpu:
                thread.start()
                first = wait_count(stack, out, 1, alive=lambda: not failed)
                at_first = cpu.sample()
                last = wait_count(stack, out, windows, alive=lambda: not failed)
                cpu_s = cpu_between(at_first, cpu.sample())
                thread.join()
            if failed:
                raise SystemExit(f"the Flink job failed: {failed[0]}")
            rate, got = timed_n / max(last - first, 1e-9), count_records(stack.kafka, out)
            cpu_us, cores = cpu_s / timed_n * 1e6, cpu_s / max(last - first, 1e-9)
            single = single or rate
            print(f"  Flink SQL job, parallelism {parallelism} (bounded, mini-cluster; first window out → last, over "
                  f"the {timed_n:,} readings between; {first - started:.0f} s to its first window)   {rate:>10,.0f} "
                  f"readings/s   {rate / raw:.3f}×   {cpu_us:5.2f} µs CPU/reading ({cores:.2f} cores busy; "
                  f"{rate / parallelism:,.0f} readings/s a slot)   ({got:,} windows out; {rate / single:.2f}× "
                  f"parallelism 1; {rate / engine.rate:.2f}× the embedded engine)")
            emit(Figure(f"feature windows: Flink SQL job, parallelism {parallelism} (mini-cluster, first window → last)",
                        f"{rate:,.0f} readings/s, {rate / parallelism:,.0f} a slot, {cpu_us:.1f} µs CPU/reading on "
                        f"{cores:.2f} cores (the job's JVM and Python workers; {got:,} windows out, {windows:,} "
                        f"closed by event time)",
                        f"embedded engine {engine.rate:,.0f}/s, {engine.cpu_us:.1f} µs CPU/reading",
                        f"{rate / engine.rate:.2f} (goal ≥ 1 at parallelism 1)"
                        + (f"; {rate / single:.2f}× parallelism 1 (goal ≥ 1.6)" if parallelism == 2 else ""),
                        n=n, batch="-", benchmark="bench_features", value=rate))


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


def _closed_client(job: tuple[str, FeastLayout, int, int, float, int]) -> tuple[int, float, np.ndarray]:
    """One client in a closed loop for ``seconds``: (calls, wall seconds, latencies in ms)."""
    url, layout, devices, keys, seconds, seed = job
    client = redis.Redis.from_url(url, socket_timeout=5)
    rng = np.random.default_rng(seed)
    read_online_features(client, ["dev-00000"], layout)  # connected before the clock starts
    lat = []
    started = time.perf_counter()
    while (now := time.perf_counter()) - started < seconds:
        ids = [f"dev-{i:05d}" for i in rng.integers(0, devices, keys)]
        read_online_features(client, ids, layout)
        lat.append(time.perf_counter() - now)
    wall = time.perf_counter() - started
    client.close()
    return len(lat), wall, np.array(lat) * 1000


def online_reads(stack: StackSettings, layout: FeastLayout, devices: int, seconds_each: float = 2.0) -> None:
    """Closed loop with 1 and 4 concurrent clients (processes): calls/s are the calls completed over the wall
    time, so the clients' own work and their contention count (not 1/mean latency)."""
    from multiprocessing import Pool

    print(f"online reads, closed loop ({devices:,} devices in Feast's layout, read_online_features; {_load()}):")
    for clients in (1, 4):
        for keys in (1, 10, 100):
            with Pool(clients) as pool:
                done = pool.map(_closed_client, [(stack.redis_url, layout, devices, keys, seconds_each, seed)
                                                 for seed in range(clients)])
            calls = sum(c for c, _, _ in done)
            rate = calls / max(w for _, w, _ in done)
            ms = np.concatenate([m for _, _, m in done])
            print(f"  {clients} client{'s' if clients > 1 else ' '} {keys:>3} keys/call  p50 {np.percentile(ms, 50):6.3f} ms  "
                  f"p99 {np.percentile(ms, 99):6.3f} ms  {rate:>8,.0f} calls/s  {rate * keys:>9,.0f} keys/s")
            emit(Figure(f"online feature reads, closed loop, {clients} concurrent client{'s' if clients > 1 else ''}, "
                        f"{keys} key{'s' if keys > 1 else ''} per call", f"{rate:,.0f} calls/s, p99 "
                        f"{np.percentile(ms, 99):.2f} ms", n=calls, batch=keys, benchmark="bench_features"))


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


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from ``/proc/<pid>/status``: resident now, and its peak."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _wait_member(stack: StackSettings, group: str, worker: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the Faust worker's consumer group is stable with partitions assigned (the worker is up)."""
    admin = AdminClient(stack.kafka.config())
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
    consumer = Consumer(stack.kafka.config({"group.id": group, "enable.auto.commit": False}))  # reads the group's committed offsets; never joins it
    tps = [TopicPartition(topic, p) for p in range(3)]
    t0 = time.monotonic()
    try:
        while True:
            if worker.poll() is not None:
                raise SystemExit(f"the Faust worker exited with {worker.returncode}")
            ends = [consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps]
            committed = [max(tp.offset, 0) for tp in consumer.committed(tps, timeout=10)]
            lag = sum(e - c for e, c in zip(ends, committed, strict=True))
            if sum(ends) == n and lag == 0 and count_records(stack.kafka, changelog) >= n:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"{group}: lag {lag} on {topic} after {timeout_s}s")
            time.sleep(0.5)
    finally:
        consumer.close()


def faust_memory_per_10k_devices(tmp: Path, stack: StackSettings, devices: int = 10_000, settle_s: float = 5.0) -> float:
    """The Faust job's own process: RSS after start-up with no devices, then after ``devices`` devices' state
    (half-full 5 s windows: 25 readings each at 10 Hz, none closed) is built, in two halves; returns MiB per 10k.

    The worker runs as its own process, as in production and in the parity test; RSS is read from /proc only
    once its consumer group has committed every reading and its table's changelog holds one write per reading.
    The growth from start-up includes one-off costs of the first records (buffers, codecs, the producer); the
    growth between the halves is the marginal cost of state alone (RSS rarely shrinks: a high-water mark).
    """
    path, prefix = isolated(tmp)
    apply(load_topology(path), stack)
    source, output, dlq, group = (f"{prefix}.ingest.telemetry", f"{prefix}.features.device_window",
                                  f"{prefix}.dlq.features", f"{prefix}.faust-memory")
    changelog = f"{group}-entity_windows-changelog"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    halves, per_device = _half_full(devices)
    size_s = FEATURE_SET.window.size_ms / 1000
    argv = faust_job.command(sys.executable, bootstrap=stack.bootstrap_servers, registry=stack.registry_url,
                             redis_url=stack.redis_url, project=f"{prefix}-faust", source=source, output=output,
                             dlq=dlq, group=group, feature_set=str(FEATURE_SET_FILE), table=f"{prefix}.devices")
    worker = subprocess.Popen(argv, cwd=REPO, stdout=(tmp / "faust.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_member(stack, group, worker)
        time.sleep(settle_s)
        rss = [_rss_kib(worker.pid)]
        fed, took = 0, []
        for part in halves:
            produce_records(stack.kafka, source, in_codec, part, key="device_id")
            fed += len(part)
            took.append(_wait_consumed(stack, group, source, changelog, fed, worker))
            time.sleep(settle_s)
            rss.append(_rss_kib(worker.pid))
    finally:
        worker.terminate()
        worker.wait(30)
    emitted, late = count_records(stack.kafka, output), count_records(stack.kafka, dlq)
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


def embedded_memory_per_10k_devices(tmp: Path, stack: StackSettings, devices: int = 10_000, settle_s: float = 5.0) -> float:
    """The embedded engine's own process (``tangram run … features``), measured as the Faust job is: RSS after
    start-up with no devices, then after ``devices`` devices' half-full windows, fed in two halves; each reading
    counted in by the processor's ``tangram_processor_records_in_total`` before RSS is read. MiB per 10k."""
    path, prefix = isolated(tmp)
    apply(load_topology(path), stack)
    source = f"{prefix}.ingest.telemetry"
    in_codec = codec(stack.registry_url, "pm.ingest.telemetry-value", load_schema("pm.ingest.telemetry-value"))
    halves, per_device = _half_full(devices)
    with Processors(path, stack, names=["features"]) as procs:
        procs.start()
        procs.wait_joined()
        pid, url = procs.procs[("features", 0)].pid, procs.endpoints()[0]["metrics_url"]
        time.sleep(settle_s)
        rss = [_rss_kib(pid)]
        fed = 0
        for part in halves:
            produce_records(stack.kafka, source, in_codec, part, key="device_id")
            fed += len(part)
            deadline = time.monotonic() + 900
            while _records_in(url) < fed:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the embedded engine consumed fewer than {fed} readings in 900 s")
                time.sleep(0.5)
            time.sleep(settle_s)
            rss.append(_rss_kib(pid))
    (start, _), (mid, _), (end, peak) = rss
    growth = (end - start) / 1024 * 10_000 / devices
    print(f"embedded engine memory (tangram run … features, own process; {devices:,} devices × {per_device} readings): "
          f"RSS {start / 1024:.1f} → {mid / 1024:.1f} → {end / 1024:.1f} MiB (peak {peak / 1024:.1f}); "
          f"growth {growth:.1f} MiB per 10k devices")
    return growth


def _records_in(metrics_url: str) -> float:
    """``tangram_processor_records_in_total`` of one processor, from its metrics endpoint."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tangram_processor_records_in_total{"))


def _half_full(devices: int) -> tuple[list[list[dict]], int]:
    """Readings that fill half of one window per device (none closes), split into two halves of the devices."""
    size_s = FEATURE_SET.window.size_ms / 1000
    readings = recorded_readings(devices, size_s / 2, hz=FEATURE_SET.sample_hz, late_every=10**9,
                                 straggle_every=10**9)
    half = {f"dev-{i:05d}" for i in range(devices // 2)}
    return ([[r for r in readings if r["device_id"] in half], [r for r in readings if r["device_id"] not in half]],
            len(readings) // devices)


def memory(stack: StackSettings) -> None:
    """Process RSS growth per 10k devices of the Faust job and of the embedded engine: one measure for both."""
    with scratch("bench-faust-memory-") as tmp:
        faust = faust_memory_per_10k_devices(tmp, stack)
    with scratch("bench-embedded-memory-") as tmp:
        embedded = embedded_memory_per_10k_devices(tmp, stack)
    print(f"memory per 10k devices, half-full windows (process RSS growth of each): Faust job {faust:.1f} MiB, "
          f"embedded engine {embedded:.1f} MiB; Faust / embedded {faust / embedded:.2f}×")
    emit(Figure("feature state memory per 10k devices, half-full 5 s windows (process RSS growth of each)",
                f"embedded engine {embedded:.1f} MiB", f"Faust job {faust:.1f} MiB",
                f"embedded / Faust {embedded / faust:.2f}", n=10_000, batch="-", benchmark="bench_features"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=200)
    p.add_argument("--seconds", type=float, default=250.0, help="Event time of the recording (10 readings/s/device).")
    p.add_argument("--faust", action="store_true", help="Also the Faust job on the same readings.")
    p.add_argument("--flink", action="store_true", help="Also the Flink SQL job (parallelism 1 and 2) on the same readings.")
    p.add_argument("--engines-only", action="store_true", help="Only the engines.")
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
        engines(stack, args.devices, args.seconds, args.faust, args.flink)
    if args.engines_only:
        return
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
