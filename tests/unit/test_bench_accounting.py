"""The benchmarks' own bookkeeping: what the end-to-end run expects the feature stage to emit, and the
README table written from one run's results (no broker)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from pm_app import FEATURE_SET
from reference import REPO
from streams.features.compute import PartitionWindows
from streams.testing import partition_of

sys.path.insert(0, str(REPO / "benchmarks"))

from pipeline import History, fleet  # noqa: E402
from readme_table import BEGIN, END, render, write  # noqa: E402
from report import scratch  # noqa: E402


@pytest.mark.parametrize(("readings", "devices"), [(10_003, 20), (4_000, 7), (999, 10)])
def test_the_windows_a_catch_up_run_waits_for_are_those_the_engine_closes(readings, devices):
    history = History(fleet(devices), readings, end_ms=1_700_000_123_456)
    states: dict[int, PartitionWindows] = {}
    closed = sent = 0
    for key, value in history.records():
        reading = json.loads(value)
        state = states.setdefault(partition_of(key, 3), PartitionWindows(FEATURE_SET))
        _, rows = state.add(key, reading["ts"], [0.0] * 5)
        closed += len(rows)
        sent += 1
    assert sent == readings
    assert history.windows() == closed > 0


def test_the_readme_table_is_replaced_whole_between_its_markers(tmp_path):
    figure = {"path": "ingest | Kafka", "measured": "85,000 records/s", "baseline": "raw 110,000/s", "ratio": "0.77",
              "n": 600_000, "batch": 500, "benchmark": "bench_ingest", "commit": "abc1234", "at": "2026-12-01 20:00 UTC",
              "load": "load 1.00 / 1.00 / 1.00 (1/5/15 min)", "value": None}
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\n\n## Performance\n\n{BEGIN}\nold table\n{END}\n\n## Tests\n")
    write(readme, render({"machine": "2 cores", "figures": [figure]}))
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# T\n") and text.endswith(f"{END}\n\n## Tests\n")
    assert "| ingest \\| Kafka | 85,000 records/s | raw 110,000/s | 0.77 | 600,000 | 500 |" in text
    assert "commit `abc1234`" in text and "2 cores" in text


def test_a_benchmark_scratch_folder_is_removed_after_a_good_run_and_kept_with_its_logs_after_a_failure(capsys):
    with scratch("bench-test-") as good:
        (good / "job.log").write_text("fine")
    assert not good.exists()

    with pytest.raises(SystemExit), scratch("bench-test-") as bad:
        (bad / "job.log").write_text("the job's last words")
        raise SystemExit(f"the job failed: see {bad / 'job.log'}")
    try:
        assert (bad / "job.log").read_text() == "the job's last words"
        assert f"bench-test: files kept in {bad}" in capsys.readouterr().err
    finally:
        shutil.rmtree(bad)
