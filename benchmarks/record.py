"""File a benchmark run under ``benchmarks/results/runs/`` for the dashboard's history.

    python -m benchmarks.record RESULTS.json [--allow-dirty] [--results-dir DIR]

Contract: the run is copied, unchanged, to ``<kind>-<YYYYMMDDTHHMM>-<commit8>.json`` (``-2``,
``-3``, ... after it when another run of that commit and minute holds the name). A run of a
dirty tree, or one whose commit git could not name, is refused (exit 2) -- its figures belong to
no commit a reader can check out -- unless ``--allow-dirty``. Then a dirty tree's file name
ends in ``-dirty`` and the dashboard leaves it out unless built with ``--include-dirty`` (which
marks it); a run without a commit is filed as ``nocommit`` and shown labelled ``commit?``.
Exit 0 with the path printed; 2 when refused or unreadable.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from benchmarks._published import RESULTS_DIR
from benchmarks._results import ResultsError, Run, load_run


def file_name(run: Run) -> str:
    stamp = run.datetime[:16].replace("-", "").replace(":", "")  # 20261130T1942
    commit = run.commit[:8] or "nocommit"
    return f"{'+'.join(run.device_kinds)}-{stamp}-{commit}{'-dirty' if run.dirty else ''}.json"


def target(run: Run, results_dir: Path, source: Path) -> Path:
    """Where ``source`` (the file of ``run``) is filed: ``file_name(run)``, or, when another run
    already holds that name (two runs of one commit started in the same minute), the first of
    ``-2``, ``-3``, ... free or holding this very run (filing a run twice is a no-op)."""
    base = file_name(run)
    content = source.read_bytes()
    for n in range(1, 1000):
        name = base if n == 1 else base.removesuffix(".json") + f"-{n}.json"
        path = results_dir / name
        if not path.exists() or path.read_bytes() == content:
            return path
    raise ResultsError(f"{base}: 999 runs of one commit and minute are filed already")


def refusal(run: Run) -> str | None:
    """Why ``run`` must not be recorded without ``--allow-dirty``; None when it may."""
    if not run.rows:
        return "it has no benchmarks (all skipped?)"
    if run.dirty:
        return f"it ran on a dirty tree (commit {run.commit[:8]} plus uncommitted changes)"
    if not run.commit:
        return "git could not name its commit (commit_info.id is unknown)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.record",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="pytest-benchmark JSON of one run")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="record a run of a dirty tree (or without a commit), marked -dirty")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    try:
        run = load_run(args.results)
    except ResultsError as e:
        print(f"record: {e}", file=sys.stderr)
        return 2
    why = refusal(run)
    if why and not (args.allow_dirty and run.rows):
        print(f"record: refused: {why}; commit first, or pass --allow-dirty", file=sys.stderr)
        return 2
    args.results_dir.mkdir(parents=True, exist_ok=True)
    filed = target(run, args.results_dir, Path(args.results))
    shutil.copyfile(args.results, filed)
    print(f"record: {filed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
