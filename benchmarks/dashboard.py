"""Build a static HTML dashboard from benchmark result files.

    python -m benchmarks.dashboard RESULTS.json [MORE.json ...] -o dashboard.html

Each file is one run (pytest-benchmark JSON, e.g. one per commit). Runs are ordered by their
timestamp; the newest is "latest". Per device kind and scenario the page shows every figure
twice: the strategies side by side in the latest run (bars), and each strategy's history over
the runs (lines). The table of the latest figures gives, per strategy, each figure's change
against the previous run of that device kind and against the committed baseline
(``benchmarks/baselines/<kind>.json``, the gate's; ``--baselines DIR`` for another folder). A strategy that other variants of a scenario run but this one does not
(``unsafe`` reclaim on the chunked input: it crashes) shows as n/a. Inline SVG and CSS only: no script, no network, no plotting library.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from benchmarks import _svg
from benchmarks._format import fmt
from benchmarks._results import ResultsError, Run, load_run, unit_of
from benchmarks.gate import BASELINE_DIR, baseline_path_for

# Figures in the order a reader wants them; any other figure follows, sorted.
METRIC_ORDER = ("peak_bytes", "after_forward_bytes", "end_of_backward_bytes", "recompute_flops",
                "backward_flops", "step_time_ratio", "step_time_single_threaded_s",
                "step_time_multithreaded_s")
METRIC_TITLES = {
    "peak_bytes": "peak memory",
    "after_forward_bytes": "live after forward (kept for backward)",
    "end_of_backward_bytes": "live at the end of backward",
    "recompute_flops": "recompute FLOPs (backward minus backward without AC)",
    "backward_flops": "backward FLOPs",
    "step_time_ratio": "step time, single-threaded / multithreaded backward",
    "step_time_single_threaded_s": "step time, single-threaded backward (median)",
    "step_time_multithreaded_s": "step time, multithreaded backward (median)",
    "sanitizer_step_time_ratio": "step time under the sanitizer(s) / without (medians)",
    "step_time_s": "step time (median of interleaved rounds)",
    "sanitizer_step_time_min_ratio": "fastest step under the sanitizer(s) / without",
    "step_time_min_s": "step time (fastest of interleaved rounds)",
}
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1120px;
color:#222;padding:0 16px}
h1{font-size:24px;margin-bottom:4px} h2{font-size:19px;margin-top:36px;border-bottom:2px solid #ddd;
padding-bottom:4px} h3{font-size:14px;margin:14px 0 4px;color:#444}
.meta{color:#666;font-size:13px} .grid{display:grid;grid-template-columns:1fr 1fr;gap:4px 24px}
.card{border:1px solid #eee;border-radius:6px;padding:6px 10px 2px;margin:10px 0}
.key{display:inline-block;margin-right:14px;font-size:12px;color:#333}
.key i{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;
vertical-align:-1px} table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}
th:first-child,td:first-child{text-align:left} .note{color:#777;font-size:12px}
"""


def _anchor(kind: str, scenario: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", f"{kind}-{scenario}")


def _metric_sort_key(metric: str):
    return (METRIC_ORDER.index(metric) if metric in METRIC_ORDER else len(METRIC_ORDER), metric)


def _sorted_runs(runs: list[Run]) -> list[Run]:
    return sorted(runs, key=lambda r: r.datetime)  # ISO timestamps sort as text; stable otherwise


def _strategy_colours(runs: list[Run]) -> dict[str, str]:
    order: list[str] = []
    for run in runs:
        for row in run.rows:
            if row.strategy not in order:
                order.append(row.strategy)
    return {s: _svg.PALETTE[i % len(_svg.PALETTE)] for i, s in enumerate(order)}


def _delta(now, then) -> str:
    if now is None or then is None:
        return "-"
    if then == 0:
        return "0" if now == 0 else "new"
    return f"{(now - then) / abs(then):+.2%}"


def _section(kind: str, scenario: str, runs: list[Run], colours: dict[str, str],
             baseline: Run | None = None) -> str:
    # History and "latest" per device kind: a newer GPU run must not blank the CPU sections.
    runs = [run for run in runs if any(row.device_kind == kind for row in run.rows)]
    latest = runs[-1]
    # Strategies of the whole family (the scenario name before "/"), so one a variant cannot run
    # (unsafe reclaim on the chunked input) shows there as n/a instead of vanishing.
    family = scenario.split("/")[0]
    strategies: list[str] = []
    for run in runs:
        for row in run.rows:
            if (row.device_kind == kind and row.scenario.split("/")[0] == family
                    and row.strategy not in strategies):
                strategies.append(row.strategy)
    rows_by_run = [{r.strategy: r for r in run.rows if (r.device_kind, r.scenario) == (kind, scenario)}
                   for run in runs]
    metrics = sorted({m for rows in rows_by_run for r in rows.values() for m in r.metrics},
                     key=_metric_sort_key)
    latest_rows = rows_by_run[-1]
    out = [f'<h2 id="{_anchor(kind, scenario)}">{escape(scenario)} '
           f'<span class="meta">({escape(kind)})</span></h2>']
    if not latest_rows:
        out.append(f'<p class="note">not in the latest run ({escape(latest.label)}).</p>')
    out.append('<div>' + _svg.legend([(s, colours[s]) for s in strategies]) + '</div>')
    # the latest figures as a table
    out.append('<table><tr><th>strategy</th>' + "".join(
        f"<th>{escape(m)}</th>" for m in metrics) + '</tr>')
    # The previous run of this kind that has the row, and the baseline's row: the deltas.
    previous = rows_by_run[-2] if len(rows_by_run) > 1 else {}
    base_rows = ({} if baseline is None else
                 {r.strategy: r for r in baseline.rows if (r.device_kind, r.scenario) == (kind, scenario)})
    for s in strategies:
        row = latest_rows.get(s)
        cells = []
        for m in metrics:
            now = row.metrics.get(m) if row else None
            prev = previous[s].metrics.get(m) if s in previous else None
            base = base_rows[s].metrics.get(m) if s in base_rows else None
            cells.append(f"<td>{escape(fmt(m, now) if row else 'n/a')}<br><span class=\"note\">"
                         f"prev {escape(_delta(now, prev))} · base {escape(_delta(now, base))}"
                         f"</span></td>")
        out.append(f"<tr><td>{escape(s)}</td>{''.join(cells)}</tr>")
    out.append("</table>")
    labels = [run.label for run in runs]
    for metric in metrics:
        def f(v, metric=metric):
            return fmt(metric, v)

        bars = [(s, latest_rows[s].metrics.get(metric) if s in latest_rows else None, colours[s])
                for s in strategies]
        series = [(s, [rows[s].metrics.get(metric) if s in rows else None for rows in rows_by_run],
                   colours[s]) for s in strategies]
        title = METRIC_TITLES.get(metric, metric)
        history = (_svg.line_chart(labels, series, f) if len(runs) > 1 else
                   '<p class="note">history: one run so far; pass more result files to draw it.</p>')
        out.append(f'<div class="card"><h3>{escape(title)} <span class="meta">[{escape(metric)}, '
                   f'{escape(unit_of(metric) or "value")}]</span></h3><div class="grid">'
                   f'<div><div class="note">latest run ({escape(latest.label)})</div>'
                   f'{_svg.bar_chart(bars, f)}</div>'
                   f'<div><div class="note">history over {len(runs)} run(s)</div>{history}</div>'
                   f'</div></div>')
    return "\n".join(out)


def render(runs: list[Run], *, title: str = "stackfix peak-memory benchmarks",
           baselines: dict[str, Run] | None = None) -> str:
    """The dashboard page for ``runs`` (any order); ``baselines``: device kind -> baseline run."""
    baselines = baselines or {}
    if not runs:
        raise ValueError("render needs at least one run")
    runs = _sorted_runs(runs)
    colours = _strategy_colours(runs)
    groups: list[tuple[str, str]] = []
    for run in runs:
        for row in run.rows:
            if (row.device_kind, row.scenario) not in groups:
                groups.append((row.device_kind, row.scenario))
    groups.sort()
    latest = runs[-1]
    toc = " · ".join(f'<a href="#{_anchor(k, s)}">{escape(s)} ({escape(k)})</a>'
                     for k, s in groups)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = (f'<h1>{escape(title)}</h1><p class="meta">{len(runs)} run(s), latest '
            f'<b>{escape(latest.label)}</b> ({escape(latest.datetime or "no timestamp")}); '
            f'generated {generated}. Bytes: MemTracker on CPU, CUDA max_memory_allocated on GPU; '
            f'smaller is better everywhere. Under each latest figure: its change against the previous '
            f'run ("prev") and the baseline ("base": {escape(", ".join(sorted(baselines)) or "none")}).'
            f'</p><p class="meta">{toc}</p>')
    body = "\n".join(_section(k, s, runs, colours, baselines.get(k)) for k, s in groups)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{CSS}</style></head><body>{head}\n{body}</body></html>\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="pytest-benchmark JSON files, one per run")
    parser.add_argument("-o", "--output", required=True, help="HTML file to write")
    parser.add_argument("--title", default="stackfix peak-memory benchmarks")
    parser.add_argument("--baselines", type=Path, default=BASELINE_DIR,
                        help="folder of <device_kind>.json baselines (default: the gate's)")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.results]
        kinds = {k for run in runs for k in run.device_kinds}
        paths = {k: baseline_path_for(k, args.baselines) for k in sorted(kinds)}
        baselines = {k: load_run(p) for k, p in paths.items() if p.is_file()}
    except ResultsError as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2
    Path(args.output).write_text(render(runs, title=args.title, baselines=baselines))
    print(f"dashboard: {len(runs)} run(s) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
