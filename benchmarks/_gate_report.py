"""What the gate prints and writes: its table, the lines naming each memory figure that moved,
the pull-request markdown, github-action-benchmark's JSON. Standard library only."""

from __future__ import annotations

from pathlib import Path

from benchmarks._format import fmt, fmt_ratio
from benchmarks._results import Row, is_memory_metric, unit_of
from benchmarks._verdict import Comparison, Verdict


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


def markdown_report(comparisons: list[Comparison], tolerance: float,
                    published: list[Comparison] = ()) -> str:
    """The gate's verdict as GitHub markdown (a pull request comment): a headline, a table of
    the memory figures that moved or could not be compared, the published figures this run no
    longer matches, and every memory figure folded under ``<details>``."""
    memory = [c for c in comparisons if is_memory_metric(c.metric)]
    grew = [c for c in memory if c.verdict == Verdict.GREW]
    shrank = [c for c in memory if c.verdict == Verdict.SHRANK]
    moved = [c for c in memory if c.verdict != Verdict.OK]
    if grew or shrank:
        title = (f"{len(grew) + len(shrank)} memory figure(s) no longer match the baseline beyond "
                 f"{tolerance:.2%} ({len(grew)} grew, {len(shrank)} shrank)")
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

    stale = [c for c in published if c.verdict.moved]
    if stale:
        title += (f"; {len(stale)} figure(s) the README and the dashboard show no longer match "
                  "this run")
    out = [f"### Peak-memory gate: {title}", ""]
    if moved:
        out += [header, *map(line, moved), ""]
    if stale:
        out += ["Published (the latest committed run of each scenario):", "",
                header.replace("| baseline |", "| published (run) |"),
                *(line(c).replace(f"| {fmt(c.metric, c.baseline)} |",
                                  f"| {fmt(c.metric, c.baseline)} ({c.reference_commit[:8]}) |", 1)
                  for c in stale), ""]
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


def moved_lines(comparisons: list[Comparison], published: list[Comparison],
                tolerance: float) -> list[str]:
    """One line per memory figure that moved or is unmatched (against the baseline), and per
    published figure this run no longer matches."""
    lines = []
    for c in comparisons:
        what = f"{c.device_kind} {c.scenario} [{c.strategy}] {c.metric}"
        change = f"{fmt(c.metric, c.delta, signed=True)} ({fmt_ratio(c.ratio)}x)"
        if c.verdict == Verdict.GREW:
            lines.append(f"REGRESSED: {what} grew {change} > tolerance {tolerance:.2%}")
        elif c.verdict == Verdict.SHRANK:
            lines.append(f"SHRANK: {what} shrank {change} beyond tolerance {tolerance:.2%}")
        elif c.verdict.unmatched:
            why = ("has no baseline entry" if c.verdict == Verdict.NO_BASELINE
                   else "is in the baseline but was not run")
            lines.append(f"{c.verdict}: {what} {why}")
    for c in published:
        if c.verdict.moved:
            lines.append(
                f"PUBLISHED: {c.device_kind} {c.scenario} [{c.strategy}] {c.metric}: the README "
                f"and the dashboard show {fmt(c.metric, c.baseline)} (run "
                f"{c.reference_commit[:8] or 'commit?'}, {Path(c.reference_file).name}), this run "
                f"measures {fmt(c.metric, c.now)}")
    return lines
