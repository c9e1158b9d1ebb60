"""Replay and backtest throughput: an hour of the reference fleet's traffic, replayed and scored.

Needs the local stack (`tangram up`). Simulates `--minutes` of the demo fleet (20 machines at
10 Hz) into a namespace of its own (as if it had been recorded live), replays the whole range
into a run namespace, backtests model v1 over it, and prints the rates and the share of the
recorded time the backtest took. Cleans up its topics afterwards.

    .venv/bin/python benchmarks/bench_replay.py --minutes 60
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient
from rich.console import Console

from reference_app import TOPOLOGY
from report import Figure, emit
from streams.namespace import namespaced
from streams.plan import apply
from streams.replay import backtest, delete_run, replay, simulate_history
from streams.settings import StackSettings
from streams.simulation import build_simulator
from streams.topology import load_topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--devices", type=int, default=20)
    args = parser.parse_args()
    stack = StackSettings()
    console = Console()
    tag = uuid.uuid4().hex[:6]
    live = namespaced(TOPOLOGY, f"bench{tag}",
                      stack.home / "bench" / f"bench{tag}.yaml")
    topology = load_topology(live)
    apply(topology, stack)
    simulator = build_simulator(topology, entities=args.devices, seed=11)
    t = time.perf_counter()
    sent, _ = simulate_history(stack, simulator, args.minutes * 60)
    produce_s = time.perf_counter() - t
    console.print(f"recorded {sent:,} readings ({args.minutes:g} min of {args.devices} machines at 10 Hz) "
                  f"in {produce_s:.1f}s ({sent / produce_s:,.0f}/s)")
    run = replay(stack, live, run_id=f"bench{tag}")
    console.print(f"replay copy: {run.records:,} records in {run.seconds:.1f}s = {run.rate:,.0f} records/s")
    try:
        [result] = backtest(stack, run.run_id, ["1"], console=console)
        share = result.seconds / (args.minutes * 60)
        console.print(f"backtest: {result.events:,} events in {result.seconds:.1f}s = {result.rate:,.0f} events/s "
                      f"(its copy of the range, processors' start, ingest → rules, until quiet); "
                      f"{args.minutes:g} min of traffic scored in {share:.1%} of that time; "
                      f"{result.predictions:,} predictions, actions {result.actions}")
        emit(Figure(f"replay copy ({args.minutes:g} min of {args.devices} machines at 10 Hz)",
                    f"{run.rate:,.0f} records/s ({run.records:,} records in {run.seconds:.1f} s)", n=run.records,
                    batch="-", benchmark="bench_replay"))
        emit(Figure("backtest of that range, model v1, every processor (its copy included)",
                    f"{result.rate:,.0f} events/s: {args.minutes:g} min scored in {result.seconds:.1f} s, "
                    f"{share:.1%} of its duration ({result.predictions:,} predictions)", n=result.events,
                    batch="per topology", benchmark="bench_replay"))
    finally:
        delete_run(stack, run.run_id)
        admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
        for _, future in admin.delete_topics(list(topology.topics), operation_timeout=30).items():
            future.result(timeout=60)
        Path(live).unlink()


if __name__ == "__main__":
    main()
