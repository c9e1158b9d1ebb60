"""Ingest benchmark (prints figures; not a test).

Against the stack that ``TANGRAM_*`` points at (``tangram up``; only Kafka and the registry
are used), in one run:

1. **Kafka validation path**: the ``ingest`` processor (JSON → contract checks → Avro, inside
   the at-least-once delivery loop) over N readings, in records/s, and its ratio to a **raw
   confluent-kafka loop** over the same N records: consume a batch, produce it unchanged,
   wait for the acks, commit (the same guarantee, no validation). Clocks start at the first
   record consumed, so group joins are not counted.
   The raw loop runs before and after the validation path (the same records, a new consumer group
   each time) and the ratio is taken to their mean. N must be large: a consumer prefetches up to
   64 MB (librdkafka's ``queued.max.messages.kbytes``) while it joins its group, before the clock
   starts, so a short run (100,000 readings, ~25 MB) times mostly records already in memory and
   flatters the byte-copying loop (347,000/s at 100k readings, 145,000/s at 200k, 111,000/s at
   600k on this machine).
2. **HTTP ingest** (``tangram gateway http`` in its own process): closed loop with C
   concurrent clients for D seconds at batch sizes 1 and 100 → requests/s and readings/s;
   then open loop at half that request rate → p50/p99 latency (send time is the scheduled
   time, so queueing behind a slow answer counts).

    python benchmarks/bench_ingest.py [--records 600000] [--seconds 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import yaml
from confluent_kafka import Producer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baselines import raw_copy_seconds  # noqa: E402
from reference_app import SCHEMAS  # noqa: E402
from report import Figure, emit  # noqa: E402

from streams.config_center import ConfigCenter  # noqa: E402
from streams.plan import apply  # noqa: E402
from streams.run import make_runner  # noqa: E402
from streams.security import keys  # noqa: E402
from streams.settings import StackSettings  # noqa: E402
from streams.topology import load_topology  # noqa: E402

PARTITIONS = 3


def topology_file(tmp: Path) -> tuple[Path, str]:
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    doc = {
        "app": prefix,
        "schemas": str(SCHEMAS),  # the reference app's contracts
        "defaults": {"partitions": PARTITIONS},
        "topics": {f"{prefix}.raw.telemetry": {"format": "json"},
                   f"{prefix}.copy.telemetry": {"format": "json"},
                   f"{prefix}.ingest.telemetry": {"schema": "pm.ingest.telemetry-value"},
                   f"{prefix}.dlq.ingest": {"format": "bytes"}},
        "processors": {"ingest": {"kind": "streams.ingest:IngestValidator", "inputs": [f"{prefix}.raw.telemetry"],
                                  "outputs": [f"{prefix}.ingest.telemetry"], "dlq": f"{prefix}.dlq.ingest",
                                  "batch_size": 500,
                                  "params": {"entity_field": "device_id", "time_field": "ts", "ranges": {"temperature": [-40.0, 200.0], "vibration": [0.0, 100.0]}}}},
        "gateways": {"telemetry": {"processor": "ingest"}},
    }
    path = tmp / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, prefix


def reading(i: int, rng: np.random.Generator) -> dict:
    return {"event_id": f"e-{i}-{uuid.uuid4().hex[:8]}", "device_id": f"dev-{i % 200:04d}", "ts": int(time.time() * 1000),
            "temperature": float(rng.normal(60, 5)), "vibration": float(abs(rng.normal(2, 0.5))),
            "current": float(rng.normal(12, 1)), "pressure": float(rng.normal(5, 0.2)), "rpm": float(rng.normal(1500, 20))}


def fill(stack: StackSettings, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 20,
                         "queue.buffering.max.messages": 1_000_000})
    rng = np.random.default_rng(1)
    for i in range(n):
        r = reading(i, rng)
        while True:
            try:
                producer.produce(topic, json.dumps(r).encode(), r["device_id"])
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


def raw_loop(stack: StackSettings, source: str, sink: str, n: int) -> float:
    """The raw consume → produce → acks → commit loop (``baselines.py``) over the same records, in records/s."""
    return n / raw_copy_seconds(stack, source, sink, n)


def validation_path(stack: StackSettings, topology_path: Path, n: int) -> float:
    """The ingest processor in its delivery loop; records/s from the first batch."""
    runner = make_runner(load_topology(topology_path), "ingest", stack)
    runner.freeze_heap = True  # the stage timed as `tangram run` runs it
    process, state = runner.processor.process, {"done": 0, "started": None}

    def counted(batch):
        state["started"] = state["started"] or time.perf_counter()
        out = process(batch)
        state["done"] += len(batch)
        if state["done"] >= n:
            runner.stop()
        return out

    runner.processor.process = counted
    runner.run()  # returns after the batch that reached n was delivered and committed
    return n / (time.perf_counter() - state["started"])


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def http_closed(url: str, token: str, batch: int, seconds: float, concurrency: int) -> float:
    rng = np.random.default_rng(2)
    counter = {"requests": 0}
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            body = [reading(k * 10_000_000 + i + j, rng) for j in range(batch)] if batch > 1 else reading(k * 10_000_000 + i, rng)
            i += batch
            async with session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
            counter["requests"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), headers=bearer(token)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
        return counter["requests"] / (time.perf_counter() - start)


async def http_open(url: str, token: str, batch: int, seconds: float, rate: float) -> np.ndarray:
    rng = np.random.default_rng(3)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), headers=bearer(token)) as session:
        async def one(scheduled: float, i: int) -> None:
            body = [reading(900_000_000 + i * batch + j, rng) for j in range(batch)] if batch > 1 else reading(900_000_000 + i, rng)
            async with session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
            latencies.append(time.perf_counter() - scheduled)

        start, tasks = time.perf_counter(), []
        for i in range(int(seconds * rate)):
            scheduled = start + i / rate
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            tasks.append(asyncio.create_task(one(scheduled, i)))
        await asyncio.gather(*tasks)
    return np.array(latencies) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=600_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("TANGRAM_HTTP_GATEWAY_PORT", "8088")))
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    stack = StackSettings()
    path, prefix = topology_file(args.tmp)
    apply(load_topology(path), stack)
    print(f"stack {stack.bootstrap_servers}, registry {stack.registry_url}; topics {prefix}.*, {PARTITIONS} partitions")

    fill(stack, f"{prefix}.raw.telemetry", args.records)
    raw_before = raw_loop(stack, f"{prefix}.raw.telemetry", f"{prefix}.copy.telemetry", args.records)
    validated = validation_path(stack, path, args.records)
    raw_after = raw_loop(stack, f"{prefix}.raw.telemetry", f"{prefix}.copy.telemetry", args.records)
    raw = (raw_before + raw_after) / 2
    print(f"\nKafka path over {args.records:,} JSON readings (batches of 500, acks + commit per batch):")
    print(f"  raw confluent-kafka consume→produce loop   {raw:>10,.0f} records/s   (before {raw_before:,.0f}, after {raw_after:,.0f})")
    print(f"  ingest validation path (JSON → Avro)       {validated:>10,.0f} records/s   ratio {validated / raw:.2f}×")
    emit(Figure("ingest validation, Kafka → Kafka (JSON → Avro, at-least-once)", f"{validated:,.0f} records/s",
                f"raw consume→produce→commit loop {raw:,.0f}/s (before {raw_before:,.0f}, after {raw_after:,.0f})",
                f"{validated / raw:.2f} (goal ≥ 0.5)", n=args.records, batch=500, benchmark="bench_ingest"))

    # the gateway as users run it: every request shows an API key, limits far above what one machine can send
    center = ConfigCenter(stack.kafka)
    key = keys.create(center, "bench", prefix, ["telemetry"], author="bench_ingest", rate_per_s=1e9, burst=10**9)
    env = {**os.environ, "TANGRAM_HTTP_GATEWAY_PORT": str(args.http_port)}
    server = subprocess.Popen([sys.executable, "-m", "streams", "gateway", "http", str(path)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{stack.host}:{args.http_port}/v1/streams/telemetry/events"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                asyncio.run(http_closed(url, key.token, 1, 0.01, 1))
                break
            except (aiohttp.ClientError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the HTTP gateway did not start")
                time.sleep(0.3)
        print(f"\nHTTP ingest (gateway in its own process, answers after the broker's ack), {args.concurrency} clients:")
        for batch in (1, 100):
            rps = asyncio.run(http_closed(url, key.token, batch, args.seconds, args.concurrency))
            lat = asyncio.run(http_open(url, key.token, batch, args.seconds, rps / 2))
            print(f"  batch {batch:>3}: {rps:>8,.0f} requests/s ({rps * batch:>9,.0f} readings/s) closed loop;  "
                  f"open loop at {rps / 2:,.0f} req/s: p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms")
            emit(Figure(f"HTTP ingest, {batch} reading{'s' if batch > 1 else ''} per request ({args.concurrency} "
                        "concurrent clients; the answer after the broker's ack)",
                        f"{rps:,.0f} requests/s = {rps * batch:,.0f} readings/s closed loop; open loop at half that: "
                        f"p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms",
                        n=int(rps * args.seconds), batch=batch, benchmark="bench_ingest"))
    finally:
        server.terminate()
        server.wait(30)
        keys.revoke(center, key.key_id, author="bench_ingest", reason="benchmark over")


if __name__ == "__main__":
    main()
