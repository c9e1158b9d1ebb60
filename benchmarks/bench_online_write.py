"""A fleet's feature rows written to the online store, and what a reader waits meanwhile.

The windows of a whole fleet close at once (aligned tumbling windows): the feature stage writes
all their rows in one flush. A Lua script runs alone in Redis, so one script carrying every row
holds every other client (the rules' online reads, the serving API) for its whole run. The writer
sends commands of ``WRITE_CHUNK`` rows in one round trip instead; this measures both ways on the
same rows: the flush time, and the latency of a reader's ``HGET`` every millisecond meanwhile.
Needs Redis (``tangram up``)::

    .venv/bin/python benchmarks/bench_online_write.py [--devices 2734] [--flushes 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_app import FEATURE_SET  # noqa: E402
from report import Figure, emit  # noqa: E402
from streams.features.layout import FeastLayout  # noqa: E402
from streams.features.online import WRITE_CHUNK, OnlineWriter  # noqa: E402
from streams.settings import StackSettings  # noqa: E402


def run(url: str, devices: int, flushes: int, chunk: int) -> tuple[float, np.ndarray]:
    """Median flush time (ms) of ``devices`` rows in commands of ``chunk`` rows, and a reader's latencies (ms)."""
    layout = FeastLayout.of(FEATURE_SET, f"bench{uuid.uuid4().hex[:8]}")
    writer = OnlineWriter(url, layout, write_chunk=chunk)
    writer.setup()
    rng = random.Random(1)
    stop, waits = threading.Event(), []

    def reader() -> None:
        client = redis.Redis.from_url(url)
        while not stop.is_set():
            started = time.perf_counter()
            client.hget(layout.key("dev-00001"), b"_ts")
            waits.append(time.perf_counter() - started)
            time.sleep(0.001)
        client.close()

    thread = threading.Thread(target=reader)
    thread.start()
    took = []
    try:
        for k in range(flushes):
            end = 10_000 + 5_000 * k
            for i in range(devices):
                writer.stage({"device_id": f"dev-{i:05d}", "window_start": end - 5_000, "window_end": end, "count": 50,
                              **{name: rng.uniform(-1, 1) for name in FEATURE_SET.feature_names}})
            started = time.perf_counter()
            writer.flush()
            took.append(time.perf_counter() - started)
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
        keys = [layout.key(f"dev-{i:05d}") for i in range(devices)]
        writer.redis.delete(*keys)
        writer.close()
    return float(np.median(took)) * 1000, np.array(waits) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2734, help="rows a flush writes (the 50 %% latency fleet)")
    parser.add_argument("--flushes", type=int, default=10)
    args = parser.parse_args()
    url = StackSettings().redis_url
    chunked = WRITE_CHUNK
    whole_ms, whole = run(url, args.devices, args.flushes, 10**9)
    parts_ms, parts = run(url, args.devices, args.flushes, chunked)
    p99_whole, p99_parts = np.percentile(whole, 99), np.percentile(parts, 99)
    emit(Figure(f"online store: a reader's HGET while {args.devices:,} rows are written at once",
                f"p99 {p99_parts:.1f} ms, max {parts.max():.1f} ms (flush {parts_ms:.0f} ms, commands of {chunked} rows)",
                f"one script for all rows: p99 {p99_whole:.1f} ms, max {whole.max():.1f} ms (flush {whole_ms:.0f} ms)",
                f"{p99_parts / p99_whole:.2f} of the reader's p99", n=args.devices * args.flushes, batch=chunked,
                benchmark="bench_online_write"))


if __name__ == "__main__":
    main()
