"""Every benchmark in one run, then the README's performance table from that run (``make bench``).

Each benchmark runs as its own process against the stack ``TANGRAM_*`` points at, appending its
figures to one results file (``TANGRAM_BENCH_RESULTS``); the latency benchmark takes its maximum rate
from the end-to-end figure of the same run. Any benchmark that fails stops the run and the README is
left as it was. ``--quick`` runs each with small N (a smoke test of the whole chain, no README)::

    .venv/bin/python benchmarks/run_all.py [--quick] [--results ~/.tangram/bench/results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from readme_table import render, write  # noqa: E402
from report import RESULTS_ENV  # noqa: E402
from streams.settings import StackSettings  # noqa: E402

#: (script, full-run arguments, quick-run arguments)
STEPS: list[tuple[str, list[str], list[str]]] = [
    ("bench_drift.py", [], ["--stationary-seeds", "1"]),
    ("bench_ingest.py", ["--records", "600000"], ["--records", "50000", "--seconds", "1"]),
    ("bench_inference.py", ["--sizes", "1,16,64,256,1024", "--rows", "500000", "--exactly-once", "256"],
     ["--sizes", "64,256", "--rows", "5000", "--exactly-once", "256"]),
    ("bench_features.py", ["--devices", "200", "--seconds", "250", "--faust", "--flink"],
     ["--devices", "20", "--seconds", "60", "--faust"]),
    ("bench_enrichment.py", ["--devices", "200", "--seconds", "250", "--entities", "100000"],
     ["--devices", "20", "--seconds", "30", "--entities", "5000"]),
    ("bench_rules.py", ["--records", "500000", "--devices", "100000"], ["--records", "20000", "--devices", "2000"]),
    ("bench_online_write.py", [], ["--devices", "500", "--flushes", "3"]),
    ("bench_replay.py", ["--minutes", "60"], ["--minutes", "2"]),
    ("bench_e2e.py", ["--readings", "1000000", "--devices", "200"], ["--readings", "60000", "--devices", "100"]),
    ("bench_intake.py", ["--documents", "16"], ["--documents", "4", "--line-documents", "2"]),
]


def e2e_rate(results: Path) -> float:
    """The one-replica end-to-end catch-up rate measured earlier in this run."""
    figures = json.loads(results.read_text())["figures"]
    return next(f["value"] for f in figures if f["benchmark"] == "bench_e2e" and f["value"] and "1 replica" in f["path"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N, no README")
    parser.add_argument("--results", type=Path, help="default: <TANGRAM_HOME>/bench/results.json")
    args = parser.parse_args()
    args.results = args.results or StackSettings().home / "bench" / "results.json"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.unlink(missing_ok=True)
    env = {**os.environ, RESULTS_ENV: str(args.results)}
    steps = [(script, quick if args.quick else full) for script, full, quick in STEPS]
    steps.append(("bench_latency.py", ["--seconds", "10" if args.quick else "30"]))
    for script, arguments in steps:
        if script == "bench_latency.py":
            arguments = [*arguments, "--max-rate", f"{e2e_rate(args.results):.0f}",
                         "--max-rate-from", "bench_e2e's one-replica catch-up rate, this run"]
        print(f"\n=== {script} {' '.join(arguments)}", flush=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, str(HERE / script), *arguments], env=env, cwd=ROOT)
        if done.returncode:
            print(f"{script} failed ({done.returncode}); the README is left as it was", file=sys.stderr)
            return done.returncode
        print(f"=== {script}: {time.monotonic() - started:.0f} s", flush=True)
    if not args.quick:
        write(ROOT / "README.md", render(json.loads(args.results.read_text())))
        print(f"README.md: performance table written from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
