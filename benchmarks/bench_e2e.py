"""End to end in catch-up mode: the whole reference topology, the raw loop and a Quix Streams peer, in one run.

N JSON readings of D devices (10 Hz, a few with faults) are produced to one raw topic first. Then,
one after the other, over the same readings:

1. **raw loop**: confluent-kafka consume → produce unchanged → acks → commit (``baselines.py``),
   what Kafka alone allows on this machine;
2. **Tangram**, the reference topology's chain (ingest → features → inference → rules, Triton and
   Redis as deployed) started with ``streams.launcher.Processors``, with 1 and then 2 replicas per
   stage, each in a namespace of its own (its own topics and consumer groups);
3. **Quix Streams** (``benchmarks/peers/quix_app.py``, its own environment ``.venv-quix``): the same
   job as a user would write it, in one process.

Each is timed from its first record (Tangram: the first validated reading's timestamp; Quix: its
first record read) to the moment everything is out and accounted for: every window predicted, the
rules stage caught up (its commits at the end of both its inputs), and, for Quix, as many
predictions as windows. It prints readings/s end to end and each ratio, what each stage emitted, and
CPU seconds per 1k readings over that same interval of each stage's processes (and of the broker,
Triton and Redis) from ``/proc``, so that the next bottleneck is visible. ``--profile`` samples each Tangram
stage with py-spy in a further run and prints where its time goes. Needs the stack (``tangram up``;
every address from ``TANGRAM_*``)::

    .venv/bin/python benchmarks/bench_e2e.py --readings 1000000 --devices 200
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baselines import raw_copy_seconds  # noqa: E402
from pipeline import CHAIN, Counts, CpuMeter, History, fleet, produce, reference_copy, stack_pids, topics_of  # noqa: E402
from reference_app import FEATURE_SET, MODEL_ONNX  # noqa: E402
from report import Figure, emit, load  # noqa: E402
from streams.launcher import LauncherSettings, Processors  # noqa: E402
from streams.plan import apply  # noqa: E402
from streams.settings import StackSettings  # noqa: E402
from streams.testing import create_topics  # noqa: E402
from streams.topology import load_topology  # noqa: E402

QUIX_PYTHON = ROOT / ".venv-quix" / "bin" / "python"
QUIX_APP = ROOT / "benchmarks" / "peers" / "quix_app.py"


@dataclass
class Run:
    """One system over the readings: how long, what it emitted, what its processes cost."""

    name: str
    label: str  # a column title
    readings: int
    seconds: float
    emitted: dict[str, int]
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.readings / self.seconds


def wait_until(done, what: str, timeout_s: float, alive=lambda: True, poll_s: float = 0.05) -> float:
    """Poll ``done()`` until it holds; returns the wall time (``time.time()``) it was first seen true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return time.time()
        if not alive():
            raise SystemExit(f"{what}: a process exited; see its log")
        time.sleep(poll_s)
    raise SystemExit(f"{what}: not done within {timeout_s:.0f} s")


def first_timestamp(stack: StackSettings, topic: str, partitions: int = 3) -> float:
    """The earliest record timestamp (producer's create time, seconds) among the first records of ``topic``."""
    from confluent_kafka import Consumer, TopicPartition
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"probe-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    first: dict[int, int] = {}
    deadline = time.monotonic() + 30
    try:
        while len(first) < partitions and time.monotonic() < deadline:
            for m in consumer.consume(100, 0.5):
                if m.error() is None:
                    first.setdefault(m.partition(), m.timestamp()[1])
    finally:
        consumer.close()
    return min(first.values()) / 1000


def tangram(stack: StackSettings, raw: str, history: History, replicas: int, tag: str,
            profile_dir: Path | None = None) -> Run:
    """The reference chain over the raw readings, ``replicas`` per stage; timed first record → all accounted for."""
    prefix = f"e2e{tag}r{replicas}{'p' if profile_dir else ''}"
    path = reference_copy(stack, prefix, raw, replicas)
    topology = load_topology(path)
    apply(topology, stack)
    topics = topics_of(topology)
    counts = Counts(stack)
    windows = history.windows()
    rules_inputs = topology.processors["rules"].inputs

    def accounted() -> bool:
        return (counts(topics["windows"]) >= windows and counts(topics["predictions"]) >= windows
                and counts.committed(topology.group("rules"), rules_inputs) >= sum(counts(t) for t in rules_inputs))

    ended, cpu = run_chain(stack, path, lambda: counts(topics["ingested"]) > 0, accounted, f"tangram ×{replicas}",
                           max(600.0, history.readings / 1000), profile_dir)
    started = first_timestamp(stack, topics["ingested"])
    emitted = {role: counts(topic) for role, topic in topics.items() if role != "raw"}
    counts.close()
    if emitted["ingested"] + emitted["ingest_dlq"] != history.readings:
        raise SystemExit(f"tangram ×{replicas}: {emitted['ingested']} ingested + {emitted['ingest_dlq']} dead letters "
                         f"!= {history.readings} readings")
    return Run(f"Tangram, {replicas} replica{'s' if replicas > 1 else ''} per stage", f"tangram ×{replicas}",
               history.readings, ended - started, emitted, cpu)


def run_chain(stack: StackSettings, path: Path, begun, done, what: str, timeout_s: float,
              profile_dir: Path | None = None) -> tuple[float, dict[str, float]]:
    """Launch the chain of the topology at ``path`` and wait until ``done()`` holds; returns that wall time and
    the CPU seconds of each stage's processes (replicas summed) and of the stack's servers (``[kafka]``,
    ``[triton]``, ``[redis]``) from when ``begun()`` first held (the first reading validated: the clock's
    start) to the end, so that start-up and group joins before it are not counted."""
    servers = {f"[{name}]": [pid] for name, pid in stack_pids(stack).items() if name != "registry"}
    with Processors(path, stack, names=list(CHAIN), settings=LauncherSettings()) as procs:
        procs.start()
        alive = lambda: all(p.poll() is None for p in procs.procs.values())  # noqa: E731
        meter = CpuMeter({**{name: [p.pid for (n, _), p in procs.procs.items() if n == name] for name in CHAIN},
                          **servers})
        wait_until(begun, f"{what}: a first reading validated", 180, alive=alive, poll_s=0.02)
        meter.start()
        spies = _spy(procs, profile_dir) if profile_dir else []
        ended = wait_until(done, what, timeout_s, alive=alive, poll_s=0.1)
        cpu = meter.stop()
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
    return ended, cpu


def _spy(procs: Processors, out: Path) -> list[subprocess.Popen]:
    """py-spy sampling each stage's process (raw collapsed stacks), until SIGINT."""
    out.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    return [subprocess.Popen([str(spy), "record", "--pid", str(p.pid), "--rate", "200", "--nonblocking",
                              "--format", "raw", "--output", str(out / f"{name}-{replica}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for (name, replica), p in procs.procs.items()]


def quix(stack: StackSettings, raw: str, history: History, tag: str, log_dir: Path) -> Run:
    """The Quix Streams peer over the raw readings; timed first record → as many predictions as windows."""
    if not QUIX_PYTHON.exists():
        raise SystemExit(f"{QUIX_PYTHON} is missing: `make .venv-quix/.installed` creates it")
    prefix = f"qx{tag}"
    create_topics(stack.kafka, [f"{prefix}.predictions", f"{prefix}.actions", f"{prefix}.dlq"])
    counts = Counts(stack)
    windows = history.windows()
    log = (log_dir / f"{prefix}.log").open("w")
    with tempfile.TemporaryDirectory(prefix="quix-state-") as state:
        # the benchmark's fleet is in no register: Tangram joins every window with the feature set's attribute
        # defaults, encoded by its own encoder, and the peer appends the same numbers
        attributes = ",".join(repr(v) for v in FEATURE_SET.enrichment.encode(None))
        proc = subprocess.Popen([str(QUIX_PYTHON), str(QUIX_APP), "--broker", stack.bootstrap_servers, "--source", raw,
                                 "--prefix", prefix, "--model", str(MODEL_ONNX), "--state-dir", state,
                                 "--attributes", attributes],
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        try:
            line = proc.stdout.readline()
            if not line.startswith("first-record-at "):
                raise SystemExit(f"the Quix app did not start; see {log.name}")
            started = float(line.split()[1])
            meter = CpuMeter({"quix": [proc.pid], **{f"[{n}]": [pid] for n, pid in stack_pids(stack).items()
                                                     if n == "kafka"}})
            meter.start()  # at its first record: start-up and the group join are not counted
            ended = wait_until(lambda: counts(f"{prefix}.predictions") >= windows, "quix",
                               timeout_s=max(900.0, history.readings / 500), alive=lambda: proc.poll() is None)
            cpu = meter.stop()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    emitted = {"predictions": counts(f"{prefix}.predictions"), "actions": counts(f"{prefix}.actions"),
               "dlq": counts(f"{prefix}.dlq")}
    counts.close()
    return Run("Quix Streams (one process)", "quix", history.readings, ended - started, emitted, cpu)


def profile_summary(folder: Path, top: int = 12) -> None:
    """Where each stage's time goes, from py-spy's collapsed stacks: top functions by own and by total samples."""
    for path in sorted(folder.glob("*.txt")):
        own: collections.Counter[str] = collections.Counter()
        total: collections.Counter[str] = collections.Counter()
        samples = 0
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")
            count = int(n)
            samples += count
            own[frames[-1]] += count
            for frame in set(frames):
                total[frame] += count
        if not samples:
            continue
        print(f"\n{path.stem}: {samples:,} samples (py-spy, 200 Hz; idle threads included)")
        print("  own%  total%  function")
        for frame, n in own.most_common(top):
            print(f"  {100 * n / samples:5.1f}  {100 * total[frame] / samples:5.1f}  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readings", type=int, default=1_000_000, help="N (≥ 1M for the real run)")
    parser.add_argument("--devices", type=int, default=200, help="D")
    parser.add_argument("--replicas", default="1,2", help="replicas per stage, one Tangram run each")
    parser.add_argument("--no-quix", action="store_true", help="skip the Quix Streams peer")
    parser.add_argument("--profile", action="store_true", help="a further 1-replica run under py-spy, summarised")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the launched processors on the way out
    stack = StackSettings()
    tag = uuid.uuid4().hex[:6]
    raw = f"e2e{tag}.raw.telemetry"
    create_topics(stack.kafka, [raw, f"e2e{tag}.raw_copy"])
    history = History(fleet(args.devices), args.readings, int(time.time() * 1000))
    t0 = time.perf_counter()
    n = produce(stack, raw, history.records())
    print(f"{n:,} readings of {args.devices} devices ({history.steps / 10:.0f} s of event time at 10 Hz, "
          f"{history.windows():,} windows to close) produced to {raw} in {time.perf_counter() - t0:.1f} s; {load()}",
          flush=True)

    raw_s = raw_copy_seconds(stack, raw, f"e2e{tag}.raw_copy", n)
    runs = [Run("raw consume→produce→commit loop", "raw", n, raw_s, {"copied": n})]
    print(f"  {runs[0].name}: {runs[0].rate:,.0f} readings/s", flush=True)
    for replicas in [int(r) for r in args.replicas.split(",")]:
        runs.append(tangram(stack, raw, history, replicas, tag))
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} readings/s", flush=True)
    if not args.no_quix:
        log_dir = stack.home / "bench"
        runs.append(quix(stack, raw, history, tag, log_dir))
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} readings/s", flush=True)
    report(runs, args.devices)
    if args.profile:
        folder = stack.home / "bench" / f"profile-{tag}"
        tangram(stack, raw, history, 1, tag, profile_dir=folder)
        profile_summary(folder)


def report(runs: list[Run], devices: int) -> None:
    raw, tangrams = runs[0], [r for r in runs if r.name.startswith("Tangram")]
    peer = next((r for r in runs if r.name.startswith("Quix")), None)
    n = raw.readings
    print(f"\nend to end, catch-up, {n:,} readings of {devices} devices ({load()}):")
    print(f"  {'system':<40} {'readings/s':>11} {'seconds':>8} {'× raw loop':>10}" + ("  × Quix" if peer else ""))
    for run in runs:
        vs_peer = f"  {run.rate / peer.rate:6.2f}" if peer else ""
        print(f"  {run.name:<40} {run.rate:>11,.0f} {run.seconds:>8.1f} {run.rate / raw.rate:>10.3f}{vs_peer}")
    print("\nemitted:")
    for run in runs[1:]:
        print(f"  {run.name}: " + ", ".join(f"{k} {v:,}" for k, v in run.emitted.items()))
    print("\nCPU seconds per 1k readings (user + system, from /proc; [x] = a server of the stack):")
    measured = runs[1:]
    names = list(dict.fromkeys(k for run in measured for k in run.cpu_s))
    print(f"  {'process':<12}" + "".join(f" {run.label:>12}" for run in measured))
    for name in [*names, "total"]:
        cells = [sum(run.cpu_s.values()) if name == "total" else run.cpu_s.get(name) for run in measured]
        print(f"  {name:<12}" + "".join(f" {1000 * c / n:>12.3f}" if c is not None else f" {'':>12}" for c in cells))
    best = max(tangrams, key=lambda r: r.rate)
    for run in tangrams:
        emit(Figure(f"end to end, catch-up: {run.name.lower()} (ingest → features → inference → rules)",
                    f"{run.rate:,.0f} readings/s ({run.emitted['windows']:,} windows, {run.emitted['predictions']:,} "
                    f"predictions, {sum(v for k, v in run.emitted.items() if k.startswith('action:')):,} actions)",
                    f"raw loop {raw.rate:,.0f}/s", f"{run.rate / raw.rate:.3f} (goal ≥ 50k readings/s)",
                    n=n, batch="per topology", benchmark="bench_e2e", value=run.rate))
    if peer:
        emit(Figure("end to end, catch-up: Quix Streams peer (same job, one process)",
                    f"{peer.rate:,.0f} readings/s ({peer.emitted['predictions']:,} predictions, "
                    f"{peer.emitted['actions']:,} actions)", f"Tangram best {best.rate:,.0f}/s",
                    f"Tangram / Quix {best.rate / peer.rate:.2f} (goal ≥ 2)", n=n, batch="-", benchmark="bench_e2e"))


if __name__ == "__main__":
    main()
