"""What every benchmark figure carries, and the results file ``make bench`` fills.

A figure names its N, its batch size and the commit it measured; it is printed as it is measured
and, when ``TANGRAM_BENCH_RESULTS`` names a JSON file, appended to it. ``benchmarks/readme_table.py``
renders that file as the README's performance table, so the table is always one run's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from reference_app import REPO as PROJECT_ROOT

RESULTS_ENV = "TANGRAM_BENCH_RESULTS"


def commit() -> str:
    """The short hash of HEAD, ``+dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    """Cores, memory and CPU model of this machine."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{os.cpu_count()} cores ({model}), {pages / 2**30:.0f} GiB, Python {platform.python_version()}"


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A folder for one benchmark's files (its topology copies, the logs of the jobs it starts): removed when
    the benchmark ends well, kept when it fails, with its path on stderr, since its error names the logs."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    except BaseException:
        print(f"{prefix.rstrip('-')}: files kept in {folder}", file=sys.stderr)
        raise
    shutil.rmtree(folder, ignore_errors=True)


def load() -> str:
    """The load averages now: other work on the machine shows in every figure taken with it."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min)"


@dataclass(frozen=True)
class Figure:
    """One measured figure beside its baseline from the same run."""

    path: str  # what was measured
    measured: str
    baseline: str = ""
    ratio: str = ""  # measured / baseline, with the goal when there is one
    n: int = 0  # records the figure is over
    batch: int | str = ""
    benchmark: str = ""
    value: float | None = None  # the measured figure as a number, for a later benchmark of the same run
    commit: str = field(default_factory=commit)
    at: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    load: str = field(default_factory=load)

    def line(self) -> str:
        parts = [f"{self.path}: {self.measured}"]
        if self.baseline:
            parts.append(f"baseline {self.baseline}")
        if self.ratio:
            parts.append(f"ratio {self.ratio}")
        parts.append(f"[N={self.n:,}, batch {self.batch or '-'}, commit {self.commit}, {self.load}]")
        return "; ".join(parts)


def emit(figure: Figure) -> Figure:
    """Print ``figure`` with its N, batch and commit; append it to ``$TANGRAM_BENCH_RESULTS`` if set."""
    print(figure.line(), flush=True)
    if path := os.environ.get(RESULTS_ENV):
        results = Path(path)
        doc = json.loads(results.read_text()) if results.exists() else {"machine": machine(), "figures": []}
        doc["figures"].append(asdict(figure))
        results.write_text(json.dumps(doc, indent=2) + "\n")
    return figure
