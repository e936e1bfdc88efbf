"""Compare a benchmark run to the committed figures of its device kind; fail when a memory
figure no longer matches them, either way.

    python -m benchmarks.gate RESULTS.json [--baseline PATH] [--tolerance 0.005]
                              [--allow-missing] [--github-json PATH] [--markdown PATH]
                              [--explain] [--refresh]

Two references, both committed:

- the baseline, pytest-benchmark JSON filed per device kind under
  ``benchmarks/baselines/<kind>.json`` (``--baseline`` uses one file for every row instead);
- the published figures: the latest committed run of each scenario on the run's device kinds
  under ``benchmarks/results/runs/`` -- what the dashboard and the README's generated table show
  (``benchmarks._published``).

Prints one line per figure against the baseline (scenario, strategy, metric, baseline, now,
delta, ratio, verdict: ``benchmarks._verdict``), then each memory figure that moved beyond the
tolerance against either reference. ``--markdown`` writes the verdict and the memory figures
that moved as GitHub markdown (``ci/benchmarks.yml`` posts it on the pull request).

Exit status: 0 every memory figure (``*_bytes``) within the tolerance of both references; 1 a
memory figure grew or shrank beyond it (a figure that shrank no longer describes the code
either); 2 the run cannot be compared (no baseline file for a device kind, a benchmark without
a baseline entry or a baseline entry the run lacks -- unless ``--allow-missing`` -- or an
unreadable file). Other figures (FLOPs, time ratios) are shown, not gated.

``--refresh`` is how a change that moves a figure on purpose updates what is committed, in the
same change: from a run of a clean, committed tree it replaces the baseline entries whose memory
figures moved (or that had none) with the run's, each stamped with the commit that measured it
(``benchmarks._baseline``); files the run under ``benchmarks/results/runs/`` (as
``python -m benchmarks.record``), so the dashboard shows it; and rewrites README.md's generated
table from the committed runs and this one (``benchmarks.headline``). Then it compares again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from benchmarks import headline
from benchmarks._baseline import BASELINE_DIR, baseline_path_for, load_baselines, refresh_baseline
from benchmarks._gate_report import (
    format_table,
    github_benchmark_entries,
    markdown_report,
    moved_lines,
)
from benchmarks._published import RESULTS_DIR, published_rows, published_runs
from benchmarks._results import ResultsError, Row, Run, is_memory_metric, load_run
from benchmarks._verdict import (
    DEFAULT_TOLERANCE,
    Comparison,
    Verdict,
    check_tolerance,
    compare,
)

README = Path(__file__).resolve().parent.parent / "README.md"
EXIT_OK, EXIT_MOVED, EXIT_INCOMPARABLE = 0, 1, 2
DASHBOARD_COMMAND = ("python -m benchmarks.dashboard -o benchmarks/results/dashboard.html "
                     "--screenshot benchmarks/results/dashboard.png")
__all__ = ["BASELINE_DIR", "DEFAULT_TOLERANCE", "EXIT_INCOMPARABLE", "EXIT_MOVED", "EXIT_OK",
           "Comparison", "Verdict", "baseline_path_for", "check_tolerance", "compare",
           "load_baselines", "load_run", "main"]


def smallest_strategy_gap(rows: list[Row]) -> tuple[float, str] | None:
    """The smallest relative difference between two strategies' memory figures within one
    scenario, ignoring equal figures (those are asserted equal by the benchmarks): the effect
    size a tolerance must stay below."""
    best: tuple[float, str] | None = None
    groups: dict[tuple[str, str, str], list[tuple[str, float]]] = {}
    for row in rows:
        for metric, value in row.metrics.items():
            if is_memory_metric(metric):
                groups.setdefault((row.device_kind, row.scenario, metric), []).append((row.strategy, value))
    for (kind, scenario, metric), values in groups.items():
        for i, (sa, a) in enumerate(values):
            for sb, b in values[i + 1:]:
                if a != b and max(a, b) > 0:
                    gap = abs(a - b) / max(a, b)
                    if best is None or gap < best[0]:
                        best = (gap, f"{kind} {scenario} {metric}: {sa} vs {sb}")
    return best


def _refresh(run: Run, args, comparisons: list[Comparison]) -> Path:
    """``--refresh``: see the module docstring; returns the file the run is filed as (not
    committed yet, so not among the files git tracks). Raises ResultsError before writing
    anything when the run names no commit or the README has no generated block to fill."""
    from benchmarks import record

    why = record.refusal(run)
    if why:
        raise ResultsError(f"--refresh needs a run of a clean, committed tree: {why}; commit, "
                           "then run the benchmarks again")
    readme = Path(args.readme)
    if readme.exists():
        headline.block_span(readme.read_text(), readme)  # markers present, or ResultsError
    keys = {(c.device_kind, c.scenario, c.strategy) for c in comparisons
            if is_memory_metric(c.metric) and (c.verdict.moved or c.verdict == Verdict.NO_BASELINE)}
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    filed = record.target(run, results_dir, Path(args.results))
    if not filed.exists():
        shutil.copyfile(args.results, filed)
        print(f"refresh: run filed as {filed}")
    data = json.loads(Path(args.results).read_text())
    for done in refresh_baseline(run, data, keys, filed_as=filed.name,
                                 baseline_dir=Path(args.baseline_dir)):
        print(f"refresh: {done.path}: {done.replaced + done.added} row(s) from {run.commit[:8]} "
              f"({done.replaced} replaced, {done.added} added)")
    if readme.exists():
        changed = headline.write_readme(readme, published_runs(results_dir, extra=[filed]))
        print(f"refresh: {readme}: generated blocks {'rewritten' if changed else 'unchanged'}")
    print(f"refresh: rebuild the page from the committed runs: {DASHBOARD_COMMAND}")
    return filed


def _load(args, filed: tuple[Path, ...] = ()) -> tuple[Run, list[Row], list[Row]]:
    run = load_run(args.results)
    if not run.rows:
        raise ResultsError(f"{args.results}: no benchmarks in the run (all skipped?)")
    baseline_rows: list[Row] = []
    try:
        baseline_rows = load_baselines(run, baseline=args.baseline,
                                       baseline_dir=Path(args.baseline_dir))
    except ResultsError:
        if not args.refresh:  # --refresh creates a missing baseline file
            raise
    shown = published_rows(published_runs(Path(args.results_dir), extra=filed), run.device_kinds)
    return run, baseline_rows, shown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="pytest-benchmark JSON of the run to check")
    parser.add_argument("--baseline", help="baseline JSON for every row (default: per device kind "
                        f"from {BASELINE_DIR})")
    parser.add_argument("--baseline-dir", default=str(BASELINE_DIR), help=argparse.SUPPRESS)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help=argparse.SUPPRESS)
    parser.add_argument("--readme", default=str(README), help=argparse.SUPPRESS)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"allowed relative change of a memory figure (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--allow-missing", action="store_true",
                        help="do not fail on benchmarks without a baseline entry or baseline entries not run")
    parser.add_argument("--github-json", metavar="PATH",
                        help="also write github-action-benchmark customSmallerIsBetter JSON here")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the verdict as GitHub markdown here (a PR comment)")
    parser.add_argument("--explain", action="store_true",
                        help="print the smallest gap between strategies (what the tolerance must stay below)")
    parser.add_argument("--refresh", action="store_true",
                        help="make this run (of a clean, committed tree) the committed figures: "
                        "replace the moved baseline entries, file the run under benchmarks/results/runs/ "
                        "and rewrite README.md's generated table")
    args = parser.parse_args(argv)
    try:
        tolerance = check_tolerance(args.tolerance)
    except ValueError as e:
        parser.error(str(e))
    if args.refresh and args.baseline:
        parser.error("--refresh writes the per-kind baselines; it cannot be used with --baseline")

    try:
        run, baseline_rows, shown = _load(args)
        if args.refresh:
            filed = _refresh(run, args, compare(run.rows, baseline_rows, tolerance=tolerance))
            run, baseline_rows, shown = _load(args, (filed,))
    except ResultsError as e:
        print(f"gate: cannot compare: {e}", file=sys.stderr)
        return EXIT_INCOMPARABLE

    if args.github_json:
        Path(args.github_json).write_text(json.dumps(github_benchmark_entries(run.rows), indent=2) + "\n")

    comparisons = compare(run.rows, baseline_rows, tolerance=tolerance)
    published = compare(run.rows, shown, tolerance=tolerance, reference="published")
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(comparisons, tolerance, published))
    print(format_table(comparisons))
    print()
    if args.explain:
        gap = smallest_strategy_gap(baseline_rows)
        if gap:
            print(f"smallest gap between strategies in the baseline: {gap[0]:.2%} ({gap[1]})")

    for line in moved_lines(comparisons, published, tolerance):
        print(line)
    grew = sum(c.verdict == Verdict.GREW for c in comparisons)
    shrank = sum(c.verdict == Verdict.SHRANK for c in comparisons)
    stale = sum(c.verdict.moved for c in published)
    unmatched = any(c.verdict.unmatched for c in comparisons)
    if grew or shrank:
        print(f"gate: {grew + shrank} memory figure(s) no longer match the baseline ({grew} grew, "
              f"{shrank} shrank)")
    if stale:
        print(f"gate: {stale} published figure(s) no longer match this run")
    if grew or shrank or stale:
        print(f"gate: if the change is intended, refresh in this change: python -m benchmarks.gate "
              f"{args.results} --refresh (replaces the moved baseline entries, files the run under "
              f"benchmarks/results/runs/ and rewrites README.md's generated table); then rebuild the "
              f"page: {DASHBOARD_COMMAND}")
        return EXIT_MOVED
    if unmatched and not args.allow_missing:
        print("gate: the run and the baseline do not cover the same benchmarks; refresh the baseline "
              "or pass --allow-missing")
        return EXIT_INCOMPARABLE
    checked = sum(1 for c in comparisons if c.verdict == Verdict.OK)
    print(f"gate: {checked} memory figure(s) within {tolerance:.2%} of the baseline"
          f"{f' and {sum(1 for c in published if c.verdict == Verdict.OK)} of the published figures' if published else ''}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
