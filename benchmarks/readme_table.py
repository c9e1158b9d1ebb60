"""Write the README's performance table from one ``make bench`` run's results file.

The table sits between two markers in README.md and is replaced whole, with the commit, the machine,
the date and the load beside it, so that it always says what one run of the code measured::

    .venv/bin/python benchmarks/readme_table.py .tangram/bench/results.json README.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BEGIN = "<!-- bench:begin (written by `make bench`: benchmarks/readme_table.py) -->"
END = "<!-- bench:end -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(doc: dict) -> str:
    """The markdown table of a results document (``benchmarks.report``'s format)."""
    figures = doc["figures"]
    if not figures:
        raise ValueError("the results file holds no figures")
    commits = sorted({f["commit"] for f in figures})
    dates = sorted(f["at"] for f in figures)
    lines = [
        f"Measured by `make bench` in one run at commit {', '.join(f'`{c}`' for c in commits)}, "
        f"{dates[0]} to {dates[-1]}, on {doc['machine']} (the broker, Triton, Redis and every processor on it; "
        f"{figures[0]['load']} at the start, {figures[-1]['load']} at the end).",
        "",
        "| path | measured | baseline (same run) | ratio | N | batch |",
        "|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append("| " + " | ".join(_cell(x) for x in (f["path"], f["measured"], f["baseline"], f["ratio"],
                                                            f"{f['n']:,}" if f["n"] else "", f["batch"])) + " |")
    return "\n".join(lines)


def write(readme: Path, table: str) -> None:
    """Replace what is between the markers of ``readme`` with ``table``."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no `{BEGIN}` … `{END}` markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    results, readme = Path(argv[0]), Path(argv[1])
    write(readme, render(json.loads(results.read_text())))
    print(f"{readme}: performance table written from {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
