"""The drift job's statistics on simulated feature windows: false alarms and detection delays (no Kafka).

    .venv/bin/python benchmarks/bench_drift.py [--stationary-seeds 5] [--window 300] [--step 100] [--consecutive 3]

Prints:
- the false-alarm rate on stationary streams (fresh fleets drawn like the training fleet, windows
  in random order): evaluations with any feature flagged, and sustained-drift alerts per evaluation,
  against the declared rate;
- the detection delay of injected drifts (shift, scale, new category; several magnitudes) in
  feature windows after the onset, and in seconds for a 20-device and a 300-device fleet
  (one window per device every 5 s), against the declared delay;
- the time one evaluation of the features the drift job compares takes (the window aggregates: the
  topology's ``compare: aggregates``).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from report import Figure, emit

from reference_app import FEATURE_NAMES
from pm_app.drift import (
    DECLARED_ALERT_RATE, declared_delay_rows, detect, false_alarms, feature_rows, references, stamp,
)
from pm_app.simulator import Drift
from pm_app.train import DatasetParams, build_dataset
from streams.monitor.stats import DriftDetector, Thresholds

DRIFTS = (
    Drift("temperature", "shift", 0.5), Drift("temperature", "shift", 1.0), Drift("temperature", "shift", 2.0),
    Drift("current", "shift", 0.5), Drift("rpm", "shift", 20.0),
    Drift("vibration", "scale", 1.2), Drift("vibration", "scale", 1.5),
    Drift("pressure", "category", 9.0, share=0.05), Drift("pressure", "category", 9.0, share=0.2),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stationary-seeds", type=int, default=5)
    parser.add_argument("--window", type=int, default=300)
    parser.add_argument("--step", type=int, default=100)
    parser.add_argument("--consecutive", type=int, default=3)
    parser.add_argument("--ks-pvalue", type=float, default=1e-3)
    parser.add_argument("--psi", type=float, default=0.2)
    args = parser.parse_args()
    console = Console()
    thresholds = Thresholds(ks_pvalue=args.ks_pvalue, psi=args.psi, consecutive=args.consecutive)
    params = DatasetParams()

    t0 = time.perf_counter()
    x = build_dataset(params.n_devices, params.seconds, params.window_s, params.hz, params.seed,
                      params.defaults_share).x
    refs = references({name: x[:, j] for j, name in enumerate(FEATURE_NAMES)})
    console.print(f"reference: {len(x):,} training windows of dataset {params.version}, rebuilt in "
                  f"{time.perf_counter() - t0:.1f}s; thresholds {thresholds.model_dump()}, window {args.window}, "
                  f"step {args.step}")

    evaluations = flagged = alerts = 0
    for seed in range(1000, 1000 + args.stationary_seeds):
        fa = false_alarms(refs, stamp(feature_rows(params, seed), 300, params.window_s), thresholds, args.window,
                          args.step)
        evaluations, flagged, alerts = evaluations + fa.evaluations, flagged + fa.flagged, alerts + fa.alerts
    console.print(f"stationary: {evaluations} evaluations over {args.stationary_seeds} fresh fleets: "
                  f"{flagged} with a feature flagged ({flagged / evaluations:.2%}), {alerts} sustained alerts "
                  f"({alerts / evaluations:.2%} per evaluation; declared ≤ {DECLARED_ALERT_RATE:.0%})")

    declared = declared_delay_rows(args.step, args.consecutive)
    table = Table(title=f"detection delay after the onset (declared ≤ {declared} windows for one fleet spread)")
    for col in ("drift", "alerted on", "windows", "s, 20 devices", "s, 300 devices"):
        table.add_column(col, justify="left" if col in ("drift", "alerted on") else "right")
    before = feature_rows(params, 2001)[:1000]
    for i, drift in enumerate(DRIFTS):
        after = feature_rows(params, 3000 + i, [drift])
        d = detect(refs, before, after, drift, thresholds, args.window, args.step)
        what = f"{drift.sensor} {drift.kind} {drift.amount:g}" + (f" ({drift.share:.0%})" if drift.kind == "category" else "")
        if d.delay_rows is None:
            table.add_row(what, "[yellow]not detected[/]", f"> {len(after)}", "-", "-")
        else:
            table.add_row(what, d.feature or "-", str(d.delay_rows), f"{d.delay_s(20, params.window_s):.0f}",
                          f"{d.delay_s(300, params.window_s):.1f}")
    console.print(table)

    detector = DriftDetector(refs, window=args.window, step=args.step)
    detector.add(before[: args.window], thresholds)
    t0 = time.perf_counter()
    runs = 20
    for _ in range(runs):
        detector.evaluate(thresholds)
    per = (time.perf_counter() - t0) / runs
    console.print(f"one evaluation of {len(refs)} features against {len(x):,} reference windows: {per * 1000:.1f} ms "
                  f"({args.step / per:,.0f} feature windows/s of evaluation capacity at step {args.step})")
    emit(Figure("drift: false alarms on stationary streams (fresh fleets drawn like the training fleet)",
                f"{alerts} sustained alerts in {evaluations} evaluations ({flagged} with a feature flagged)",
                f"declared ≤ {DECLARED_ALERT_RATE:.0%} per evaluation", f"{alerts / evaluations:.2%}",
                n=evaluations, batch=f"window {args.window}, step {args.step}", benchmark="bench_drift"))
    emit(Figure(f"drift: one evaluation of {len(refs)} features against {len(x):,} reference windows",
                f"{per * 1000:.1f} ms ({args.step / per:,.0f} feature windows/s at step {args.step})",
                n=runs, batch=f"window {args.window}", benchmark="bench_drift"))


if __name__ == "__main__":
    main()
