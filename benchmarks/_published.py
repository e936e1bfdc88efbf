"""The figures a reader sees: the committed runs under ``benchmarks/results/runs/``, and of them the
latest run of each scenario on each device kind -- what the dashboard's sections, its headline
table and the README's generated table show (``benchmarks._views`` picks the same runs).

Contract:
- ``committed_result_files(dir)``: the ``*.json`` files git tracks directly in ``dir`` (every
  ``*.json`` there where git cannot answer: not a checkout, or git missing).
- ``published_runs(dir, extra=())``: those files read, plus ``extra`` (a run just filed and
  not yet committed), runs of a dirty tree left out.
- ``published_rows(runs, kinds)``: per (kind, scenario) of ``kinds`` the rows of the latest
  run that has that scenario, each row carrying that run's commit and file.
Standard library only.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

from benchmarks._results import Row, Run, load_run

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "runs"


def committed_result_files(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """The results files git tracks under ``results_dir`` (all ``*.json`` there without git)."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        return []
    try:
        out = subprocess.run(["git", "ls-files", "--", "*.json"], cwd=results_dir, check=True,
                             capture_output=True, text=True).stdout.split()
        files = [results_dir / f for f in out if "/" not in f]
    except (OSError, subprocess.CalledProcessError):
        files = sorted(results_dir.glob("*.json"))
    return sorted(files)


def published_runs(results_dir: Path = RESULTS_DIR, extra: Iterable[Path] = ()) -> list[Run]:
    paths = list(committed_result_files(results_dir))
    paths += [Path(p) for p in extra if Path(p).resolve() not in {q.resolve() for q in paths}]
    return [run for run in map(load_run, paths) if not run.dirty]


def published_rows(runs: list[Run], kinds: Iterable[str]) -> list[Row]:
    """The rows the dashboard shows for ``kinds``: per (kind, scenario), the latest run's."""
    kinds = set(kinds)
    latest: dict[tuple[str, str], Run] = {}
    for run in sorted(runs, key=lambda r: r.datetime):
        for row in run.rows:
            if row.device_kind in kinds:
                latest[(row.device_kind, row.scenario)] = run
    return [row for (kind, scenario), run in sorted(latest.items()) for row in run.rows
            if (row.device_kind, row.scenario) == (kind, scenario)]
