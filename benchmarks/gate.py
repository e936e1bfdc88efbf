"""Compare a benchmark run to the committed baseline of its device kind; fail on memory growth.

    python -m benchmarks.gate RESULTS.json [--baseline PATH] [--tolerance 0.005]
                              [--allow-missing] [--github-json PATH] [--markdown PATH]

The baseline is pytest-benchmark JSON from a reference run, filed per device kind under
``benchmarks/baselines/<kind>.json`` (``cpu.json``, ``gpu-h200.json``); ``--baseline`` uses one
file for every row instead. Prints one line per figure (scenario, strategy, metric, baseline,
now, delta, ratio, verdict); ``--markdown`` writes the verdict and the memory figures that moved
as GitHub markdown (``ci/benchmarks.yml`` posts it on the pull request).

Exit status: 0 all memory figures within tolerance; 1 a memory figure (``*_bytes``) grew by
more than the tolerance; 2 the run cannot be compared (no baseline file for a device kind, a
benchmark without a baseline entry or a baseline entry the run lacks -- unless
``--allow-missing`` -- or an unreadable file). Other figures (FLOPs, time ratios) are shown,
not gated: FLOPs are pinned by the benchmarks' own assertions, times are noisy.

Tolerance (``DEFAULT_TOLERANCE``, relative, 0.5%): the memory figures are not noisy --
MemTracker counts exact storage bytes and the caching allocator's counters are identical between
runs of one program on one software stack; two CPU runs of the whole suite gave all 51 memory
figures to the byte. So the tolerance is not there to absorb noise but allocator and kernel
drift between torch patch releases, and it must stay well below the smallest effect the
benchmarks exist to show: the smallest gap between two strategies of one scenario in the CPU
baseline is 1.65% (recompute-reclaim/chunked-mtp peak, mtp-skip vs ours), and ``--explain``
prints it for any baseline. 0.5% is under a third of that.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks._format import fmt, fmt_ratio
from benchmarks._results import ResultsError, Row, Run, is_memory_metric, load_run, unit_of

DEFAULT_TOLERANCE = 0.005
BASELINE_DIR = Path(__file__).resolve().parent / "baselines"
EXIT_OK, EXIT_REGRESSION, EXIT_INCOMPARABLE = 0, 1, 2
VERDICTS = ("ok", "REGRESSED", "improved", "info", "NO BASELINE", "NOT RUN")


@dataclass(frozen=True, slots=True)
class Comparison:
    """One figure of one benchmark, baseline vs now, and what the gate makes of it."""

    device_kind: str
    scenario: str
    strategy: str
    metric: str
    baseline: float | None
    now: float | None
    verdict: str

    @property
    def delta(self) -> float | None:
        if self.baseline is None or self.now is None:
            return None
        return self.now - self.baseline

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.now is None:
            return None
        if self.baseline == 0:
            return 1.0 if self.now == 0 else math.inf
        return self.now / self.baseline


def check_tolerance(tolerance: float) -> float:
    if not (isinstance(tolerance, int | float) and 0 <= tolerance < 1):
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
    return float(tolerance)


def _judge(metric: str, baseline: float, now: float, tolerance: float) -> str:
    if not is_memory_metric(metric):
        return "info"
    if now > baseline * (1 + tolerance):
        return "REGRESSED"
    if now < baseline * (1 - tolerance):
        return "improved"
    return "ok"


def compare(
    rows: list[Row], baseline_rows: list[Row], *, tolerance: float = DEFAULT_TOLERANCE
) -> list[Comparison]:
    """Every figure of ``rows`` against ``baseline_rows`` (matched on device kind, scenario,
    strategy), plus a NOT RUN line for each baseline figure the run lacks."""
    tolerance = check_tolerance(tolerance)
    base = {row.key: row for row in baseline_rows}
    out: list[Comparison] = []
    for row in rows:
        ref = base.get(row.key)
        for metric, now in sorted(row.metrics.items()):
            if ref is None or metric not in ref.metrics:
                verdict = "NO BASELINE" if is_memory_metric(metric) else "info"
                out.append(Comparison(*row.key, metric, None, now, verdict))
            else:
                then = ref.metrics[metric]
                out.append(Comparison(*row.key, metric, then, now, _judge(metric, then, now, tolerance)))
    ran = {(c.device_kind, c.scenario, c.strategy, c.metric) for c in out}
    for ref in baseline_rows:
        for metric, then in sorted(ref.metrics.items()):
            if is_memory_metric(metric) and (*ref.key, metric) not in ran:
                out.append(Comparison(*ref.key, metric, then, None, "NOT RUN"))
    return out


def baseline_path_for(device_kind: str, baseline_dir: Path = BASELINE_DIR) -> Path:
    return Path(baseline_dir) / f"{device_kind}.json"


def load_baselines(
    run: Run, *, baseline: str | Path | None = None, baseline_dir: Path = BASELINE_DIR
) -> list[Row]:
    """The baseline rows for ``run``: from ``baseline`` if given, else one file per device kind
    in the run. Raises ResultsError with what to do when a file is missing."""
    if baseline is not None:
        return load_run(baseline).rows
    rows: list[Row] = []
    for kind in run.device_kinds:
        path = baseline_path_for(kind, baseline_dir)
        if not path.exists():
            raise ResultsError(
                f"no baseline for device kind {kind!r}: {path} does not exist. If this run is "
                f"the reference, commit it: cp {run.path or 'RESULTS.json'} {path}"
            )
        rows += [row for row in load_run(path).rows if row.device_kind == kind]
    return rows


def format_table(comparisons: list[Comparison]) -> str:
    header = ("device", "scenario", "strategy", "metric", "baseline", "now", "delta", "ratio", "verdict")
    lines = [header]
    for c in comparisons:
        lines.append((
            c.device_kind, c.scenario, c.strategy, c.metric,
            fmt(c.metric, c.baseline), fmt(c.metric, c.now),
            fmt(c.metric, c.delta, signed=True), fmt_ratio(c.ratio), c.verdict,
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    text = []
    for n, line in enumerate(lines):
        text.append("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def markdown_report(comparisons: list[Comparison], tolerance: float) -> str:
    """The gate's verdict as GitHub markdown (a pull request comment): a headline, a table of
    the memory figures that moved or could not be compared, and every memory figure folded
    under ``<details>``."""
    memory = [c for c in comparisons if is_memory_metric(c.metric)]
    regressed = [c for c in memory if c.verdict == "REGRESSED"]
    moved = [c for c in memory if c.verdict != "ok"]
    if regressed:
        title = f"{len(regressed)} figure(s) REGRESSED beyond {tolerance:.2%}"
    elif moved:
        title = f"no regression beyond {tolerance:.2%}; {len(moved)} figure(s) moved or unmatched"
    else:
        title = f"all {len(memory)} memory figure(s) within {tolerance:.2%}"
    header = ("| device | scenario | strategy | figure | baseline | now | change | verdict |\n"
              "|---|---|---|---|---|---|---|---|")

    def line(c: Comparison) -> str:
        change = fmt(c.metric, c.delta, signed=True)
        if c.ratio is not None and c.baseline:
            change += f" ({c.ratio - 1:+.2%})"
        return (f"| {c.device_kind} | {c.scenario} | {c.strategy} | {c.metric} | "
                f"{fmt(c.metric, c.baseline)} | {fmt(c.metric, c.now)} | {change} | {c.verdict} |")

    out = [f"### Peak-memory gate: {title}", ""]
    if moved:
        out += [header, *map(line, moved), ""]
    out += ["<details><summary>every memory figure against the baseline</summary>", "",
            header, *map(line, memory), "", "</details>", ""]
    return "\n".join(out)


def github_benchmark_entries(rows: list[Row]) -> list[dict]:
    """github-action-benchmark's ``customSmallerIsBetter`` input: one entry per figure (every
    figure here is smaller-is-better: bytes, FLOPs, the single/multi-thread time ratio)."""
    entries = []
    for row in rows:
        for metric, value in sorted(row.metrics.items()):
            entries.append({
                "name": f"{row.scenario} [{row.strategy}] {metric} ({row.device_kind})",
                "unit": unit_of(metric) or "value",
                "value": value,
                "extra": row.name,
            })
    return entries


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="pytest-benchmark JSON of the run to check")
    parser.add_argument("--baseline", help="baseline JSON for every row (default: per device kind "
                        f"from {BASELINE_DIR})")
    parser.add_argument("--baseline-dir", default=str(BASELINE_DIR), help=argparse.SUPPRESS)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"allowed relative growth of a memory figure (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--allow-missing", action="store_true",
                        help="do not fail on benchmarks without a baseline entry or baseline entries not run")
    parser.add_argument("--github-json", metavar="PATH",
                        help="also write github-action-benchmark customSmallerIsBetter JSON here")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the verdict as GitHub markdown here (a PR comment)")
    parser.add_argument("--explain", action="store_true",
                        help="print the smallest gap between strategies (what the tolerance must stay below)")
    args = parser.parse_args(argv)
    try:
        tolerance = check_tolerance(args.tolerance)
    except ValueError as e:
        parser.error(str(e))

    try:
        run = load_run(args.results)
        if not run.rows:
            raise ResultsError(f"{args.results}: no benchmarks in the run (all skipped?)")
        baseline_rows = load_baselines(run, baseline=args.baseline, baseline_dir=Path(args.baseline_dir))
    except ResultsError as e:
        print(f"gate: cannot compare: {e}", file=sys.stderr)
        return EXIT_INCOMPARABLE

    if args.github_json:
        Path(args.github_json).write_text(json.dumps(github_benchmark_entries(run.rows), indent=2) + "\n")

    comparisons = compare(run.rows, baseline_rows, tolerance=tolerance)
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(comparisons, tolerance))
    print(format_table(comparisons))
    print()
    if args.explain:
        gap = smallest_strategy_gap(baseline_rows)
        if gap:
            print(f"smallest gap between strategies in the baseline: {gap[0]:.2%} ({gap[1]})")

    regressed = [c for c in comparisons if c.verdict == "REGRESSED"]
    unmatched = [c for c in comparisons if c.verdict in ("NO BASELINE", "NOT RUN")]
    improved = [c for c in comparisons if c.verdict == "improved"]
    for c in regressed:
        print(f"REGRESSED: {c.device_kind} {c.scenario} [{c.strategy}] {c.metric} grew "
              f"{fmt(c.metric, c.delta, signed=True)} ({fmt_ratio(c.ratio)}x) > tolerance {tolerance:.2%}")
    for c in unmatched:
        what = "has no baseline entry" if c.verdict == "NO BASELINE" else "is in the baseline but was not run"
        print(f"{c.verdict}: {c.device_kind} {c.scenario} [{c.strategy}] {c.metric} {what}")
    if improved:
        print(f"{len(improved)} memory figure(s) shrank by more than {tolerance:.2%}: "
              "if intended, refresh the baseline from this run")
    if regressed:
        return EXIT_REGRESSION
    if unmatched and not args.allow_missing:
        print("gate: the run and the baseline do not cover the same benchmarks; refresh the baseline "
              "or pass --allow-missing")
        return EXIT_INCOMPARABLE
    checked = sum(1 for c in comparisons if c.verdict in ("ok", "improved"))
    print(f"gate: {checked} memory figure(s) within {tolerance:.2%} of the baseline")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
