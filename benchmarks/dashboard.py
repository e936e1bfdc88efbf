"""Build the static HTML dashboard (and the README's headline table) from benchmark results.

    python -m benchmarks.dashboard [RESULTS.json ...] -o benchmarks/results/dashboard.html
                                   [--readme README.md] [--screenshot PNG] [--include-dirty]
                                   [--open ANCHOR] [--baselines DIR]

Without result files it reads the committed ones (``benchmarks/results/*.json`` that git
tracks). Contract of the page:

- Runs of a dirty tree are left out (counted at the top) unless ``--include-dirty``; then
  they are labelled ``+dirty`` (``benchmarks._views``).
- A summary table of the headline cells (``benchmarks.headline``) comes first; ``--readme``
  writes the same table into the README between its markers, and ``--screenshot`` a PNG of
  the page (headless Chromium, ``benchmarks._browser``), in the same command.
- One collapsible section per device kind and scenario, showing the latest run *of that
  scenario on that kind*. Its one-line summary (visible while collapsed) gives ours against no
  reclaim and the change since the previous run. Open, it gives per figure every strategy's
  value, its ratio and difference against no reclaim and each verl release
  (``benchmarks._compare``), its change against the previous run and the baseline
  (``baselines/<kind>.json``, the gate's), the commit, date and environment of the run, and the
  history of the figure over the scenario's runs with environment changes noted.
- A strategy that crashed is shown as ``crashed (NAME)``; one the run did not have, as
  "not in this run".
- Self-contained: inline CSS and SVG (``benchmarks._svg`` says why no plotting library), no
  script, no network. Readable at 1280 px.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from benchmarks import _browser, _svg, headline
from benchmarks._compare import REFERENCES, main_pair, note_for, reference_rows, versus
from benchmarks._format import fmt
from benchmarks._results import ResultsError, Row, Run, load_run, unit_of
from benchmarks._views import ENV_KEYS, ScenarioView, committed_runs, scenario_views
from benchmarks.gate import BASELINE_DIR, baseline_path_for

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Figures in the order a reader wants them; any other figure follows, sorted.
METRIC_ORDER = ("peak_bytes", "retained_bytes", "after_forward_bytes", "end_of_backward_bytes",
                "step_time_vs_none_ratio", "recompute_flops", "backward_flops", "step_time_ratio",
                "sanitizer_step_time_ratio")
METRIC_TITLES = {
    "peak_bytes": "peak memory",
    "retained_bytes": "kept between steps (the leak)",
    "after_forward_bytes": "live after forward (kept for backward)",
    "end_of_backward_bytes": "live at the end of backward",
    "step_time_vs_none_ratio": "step time / no reclaim (median of interleaved ratios; not gated)",
    "recompute_flops": "recompute FLOPs (backward minus backward without AC)",
    "backward_flops": "backward FLOPs",
    "step_time_ratio": "step time, single-threaded / multithreaded backward",
    "sanitizer_step_time_ratio": "step time under the sanitizer(s) / without (medians)",
    "step_time_s": "step time (median of interleaved rounds)",
    "sanitizer_step_time_min_ratio": "fastest step under the sanitizer(s) / without",
    "step_time_min_s": "step time (fastest of interleaved rounds)",
}
CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,sans-serif;margin:16px auto;max-width:1200px;
color:#222;padding:0 14px} h1{font-size:22px;margin:0 0 2px} h2{font-size:17px;margin:22px 0 6px;
border-bottom:2px solid #ddd} .meta,.note{color:#666;font-size:12px}
nav{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:0 16px;
font-size:12px;border:1px solid #eee;border-radius:6px;padding:6px 10px;margin:8px 0}
nav b{display:block;margin-top:4px} nav a{margin-right:8px;white-space:nowrap}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
td,th{padding:2px 8px;white-space:nowrap;border-bottom:1px solid #eee;text-align:right;vertical-align:top}
th{background:#f6f6f6;white-space:normal} th:first-child,td:first-child{text-align:left}
.summary td:nth-child(-n+3),.summary th:nth-child(-n+3){text-align:left} .summary td:first-child{white-space:normal}
details.scn{border:1px solid #e4e4e4;border-radius:6px;margin:4px 0;padding:0 10px}
details.scn>summary{cursor:pointer;padding:5px 0;font-size:13.5px}
details.scn[open]>summary{border-bottom:1px solid #eee;margin-bottom:6px}
.delta{font-weight:600;margin-left:8px} .good{color:#1a7f37} .bad{color:#c62828}
.crashed{color:#c62828;font-weight:600} .dirty{color:#b35;font-weight:600}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:2px 16px}
.key{display:inline-block;margin-right:12px;font-size:12px} .key i{display:inline-block;
width:10px;height:10px;border-radius:2px;margin-right:4px} h3{font-size:13px;margin:10px 0 2px}
"""


def anchor(kind: str, scenario: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", f"{kind}-{scenario}")


def _metric_sort_key(metric: str):
    return (METRIC_ORDER.index(metric) if metric in METRIC_ORDER else len(METRIC_ORDER), metric)


def _relative(now: float | None, then: float | None) -> str:
    if now is None or then is None:
        return "--"
    if then == 0:
        return "±0" if now == 0 else "new"
    change = (now - then) / abs(then)
    return "±0" if change == 0 else f"{change:+.2%}"


def _versus_cell(metric: str, v) -> str:
    if v is None or v.ratio is None:
        return "--"
    diff = "±0" if v.difference == 0 else fmt(metric, v.difference, signed=True)
    cls = "good" if v.difference < 0 else "bad" if v.difference > 0 else ""
    return f'<span class="{cls}">{v.ratio:.3f}</span> <span class="note">{escape(diff)}</span>'


def _value_cell(row: Row | None, metric: str) -> str:
    if row is None:
        return '<span class="note">not in this run</span>'
    if row.crashed:
        return f'<span class="crashed">crashed ({escape(row.crashed)})</span>'
    return escape(fmt(metric, row.metrics.get(metric)))


def _axis(metric: str):
    """Y ticks for ``metric`` as (value, label): round steps in the unit the axis is shown in
    (bytes: the binary unit of its top), printed with the decimals the step needs."""
    def ticks(lo: float, hi: float) -> list[tuple[float, str]]:
        name, size = "", 1.0
        if unit_of(metric) == "bytes":
            name, size = next(((f" {n}", s) for n, s in (("GiB", 2**30), ("MiB", 2**20),
                                                          ("KiB", 2**10)) if max(abs(lo), abs(hi)) >= s),
                              (" B", 1))
        elif unit_of(metric) == "x":
            name = "x"
        values, decimals = _svg.nice_ticks(lo / size, hi / size)
        return [(v * size, f"{v:.{decimals}f}{name}") for v in values]
    return ticks


def _env_text(point) -> str:
    env = point.env
    return " · ".join(f"{name} {escape(env[k])}" for k, name in ENV_KEYS if k in env)


def _summary_delta(view: ScenarioView, metrics: list[str]) -> str:
    pair = main_pair(view.strategies)
    if not pair or not metrics:
        return ""
    subject, reference = pair
    metric = metrics[0]
    rows = view.latest.rows
    head = f"{escape(subject)} / {escape(reference)}, {escape(metric.removesuffix('_bytes'))}: "
    if subject in rows and rows[subject].crashed:
        return f'<span class="delta">{head}<span class="crashed">crashed ({escape(rows[subject].crashed)})</span></span>'
    v = versus(rows.get(subject), rows.get(reference), metric)
    text = head + _versus_cell(metric, v)
    prev = view.previous.rows.get(subject) if view.previous else None
    now = rows.get(subject)
    change = ("none (first run)" if view.previous is None else
              _relative(now.metrics.get(metric) if now else None,
                        prev.metrics.get(metric) if prev else None))
    text += f' <span class="note">· vs previous run {escape(change)}</span>'
    return f'<span class="delta">{text}</span>'


def _figure_table(view: ScenarioView, metric: str, colours: dict[str, str]) -> str:
    latest = view.latest.rows
    refs = [(title, row) for title, row in reference_rows(latest)
            if any(n in view.strategies for n in dict(REFERENCES)[title])]
    previous = view.previous.rows if view.previous else {}
    head = "".join(f"<th>vs {escape(t)}</th>" for t, _ in refs)
    out = [f'<table><tr><th>strategy</th><th>{escape(unit_of(metric) or "value")}</th>{head}'
           f'<th>vs previous run</th><th>vs baseline</th></tr>']
    for s in view.strategies:
        row = latest.get(s)
        now = row.metrics.get(metric) if row else None
        if row is not None and not row.crashed and now is None:
            continue  # this strategy has no such figure
        cells = [_versus_cell(metric, versus(row, ref, metric)) if ref is not row else "--"
                 for _, ref in refs]
        prev = previous[s].metrics.get(metric) if s in previous else None
        base = view.baseline[s].metrics.get(metric) if s in view.baseline else None
        out.append(f'<tr><td title="{escape(note_for(s))}"><span class="key"><i style="background:'
                   f'{colours.get(s, "#999")}"></i>{escape(s)}</span></td><td>{_value_cell(row, metric)}</td>'
                   + "".join(f"<td>{c}</td>" for c in cells)
                   + f"<td>{escape(_relative(now, prev))}</td><td>{escape(_relative(now, base))}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _history(view: ScenarioView, metric: str, colours: dict[str, str]) -> str:
    if len(view.history) < 2:
        return '<p class="note">history: one committed run of this scenario so far.</p>'
    labels = [tuple(p.label.split(" ", 1)) if " " in p.label else (p.label, "") for p in view.history]
    series = [(s, [p.rows[s].metrics.get(metric) if s in p.rows else None for p in view.history],
               colours.get(s, "#999")) for s in view.strategies]
    series = [s for s in series if any(v is not None for v in s[1])]
    return _svg.line_chart(labels, series, lambda v: fmt(metric, v), _axis(metric),
                           marks=view.env_changes)


def section(view: ScenarioView, colours: dict[str, str], *, open_: bool = False) -> str:
    """One scenario on one device kind (see the module docstring)."""
    metrics = sorted(view.metrics, key=_metric_sort_key)
    latest = view.latest
    run = latest.run
    dirty = ' <span class="dirty">dirty tree</span>' if run.dirty else ""
    prev = view.previous
    out = [f'<details class="scn" id="{anchor(view.kind, view.scenario)}"{" open" if open_ else ""}>'
           f'<summary><b>{escape(view.scenario)}</b> <span class="meta">({escape(view.kind)}; '
           f'latest {escape(latest.label)})</span>{dirty}{_summary_delta(view, metrics)}</summary>',
           f'<p class="meta">latest run of this scenario on {escape(view.kind)}: commit '
           f'<b>{escape(run.commit[:12] or "unknown (no git)")}</b>{dirty}, {escape(run.date or "no date")} UTC'
           f' · {_env_text(latest) or "environment not recorded"} · file {escape(Path(run.path).name)}'
           f'<br>previous: {escape(prev.label) if prev else "none"} · baseline: '
           f'{"benchmarks/baselines/" + escape(view.kind) + ".json" if view.baseline else "none"} · '
           f'{len(view.history)} run(s) in the history</p>']
    for i, note in view.env_changes:
        out.append(f'<p class="note">environment changed at {escape(view.history[i].label)}: '
                   f'{escape(note)}</p>')
    cards = []
    for metric in metrics:
        cards.append(f'<div><h3>{escape(METRIC_TITLES.get(metric, metric))} '
                     f'<span class="meta">[{escape(metric)}]</span></h3>'
                     f'{_figure_table(view, metric, colours)}{_history(view, metric, colours)}</div>')
    out.append(f'<div class="grid">{"".join(cards)}</div></details>')
    return "\n".join(out)


def summary_table(rows: list[headline.HeadlineRow]) -> str:
    """The headline cells (the README's table), each linked to its section."""
    head = "".join(f"<th>{escape(c)}</th>" for c in headline.COLUMNS)
    out = [f'<table class="summary" id="headline"><tr>{head}</tr>']
    for row in rows:
        cells = [escape(c) for c in headline.cells_of(row)]
        cells[0] = (f'<a href="#{anchor(*row.anchor_key)}" title="{escape(row.cell.scenario)}">'
                    f'{cells[0]}</a>')
        cells = [f'<span class="crashed">{c}</span>' if c.startswith("crashed") else c for c in cells]
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _nav(views: list[ScenarioView]) -> str:
    """Links to every section, one block per family and kind, one line per model of a family
    whose scenarios have three parts (``megatron-scale/<model>/<size>/<dtype>``)."""
    groups: dict[tuple[str, str], dict[str, list[ScenarioView]]] = {}
    for v in views:
        family, _, rest = v.scenario.partition("/")
        model, _, variant = rest.partition("/") if rest.count("/") >= 1 else ("", "", rest)
        groups.setdefault((v.kind, family), {}).setdefault(model, []).append((variant or rest, v))
    out = ['<nav aria-label="scenarios">']
    for (kind, family), models in groups.items():
        lines = []
        for model, vs in models.items():
            links = " ".join(f'<a href="#{anchor(v.kind, v.scenario)}">{escape(name or v.scenario)}</a>'
                             for name, v in vs)
            lines.append(f"<div>{escape(model) + ': ' if model else ''}{links}</div>")
        out.append(f"<div><b>{escape(family)} ({escape(kind)})</b>{''.join(lines)}</div>")
    out.append("</nav>")
    return "".join(out)


def _strategy_colours(views: list[ScenarioView]) -> dict[str, str]:
    order: list[str] = []
    for v in views:
        order += [s for s in v.strategies if s not in order]
    return {s: _svg.PALETTE[i % len(_svg.PALETTE)] for i, s in enumerate(order)}


def render(runs: list[Run], *, title: str = "stackfix peak-memory benchmarks",
           baselines: dict[str, Run] | None = None, include_dirty: bool = False,
           open_sections: tuple[str, ...] = ()) -> str:
    """The page for ``runs`` (any order); ``baselines``: device kind -> baseline run;
    ``open_sections``: anchors of sections to draw expanded."""
    if not runs:
        raise ValueError("render needs at least one run")
    shown, left_out = committed_runs(runs, include_dirty=include_dirty)
    if not shown:
        raise ValueError(f"all {len(runs)} run(s) come from a dirty tree; pass include_dirty")
    views = scenario_views(shown, baselines)
    colours = _strategy_colours(views)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    dirty_note = (f"; {len(left_out)} run(s) of a dirty tree left out (--include-dirty shows them, "
                  f"marked)" if left_out else "")
    if include_dirty and any(r.dirty for r in shown):
        dirty_note = '; <span class="dirty">runs of a dirty tree included, marked +dirty</span>'
    strategies = "".join(f"<tr><td>{escape(s)}</td><td>{escape(note_for(s))}</td></tr>"
                         for s in colours if note_for(s))
    head = (f'<h1>{escape(title)}</h1><p class="meta">{len(shown)} committed run(s){dirty_note}; '
            f'generated {generated}. Bytes: MemTracker on CPU, CUDA max_memory_allocated on GPU; '
            f'smaller is better. Each section shows the latest run of that scenario on that device '
            f'kind; ratios are value / reference, differences value - reference.</p>'
            f'<h2>Headline figures (MiB)</h2>{summary_table(headline.headline_rows(views))}'
            f'<details><summary class="meta">what the strategy names mean</summary>'
            f'<table>{strategies}</table></details>{_nav(views)}')
    body = []
    for kind in sorted({v.kind for v in views}):
        body.append(f'<h2 id="{anchor(kind, "")}">{escape(kind)}</h2>')
        body += [section(v, colours, open_=anchor(v.kind, v.scenario) in open_sections)
                 for v in views if v.kind == kind]
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{escape(title)}</title><style>{CSS}</style></head><body>{head}\n'
            + "\n".join(body) + "</body></html>\n")


def committed_result_files(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """The results files git tracks under ``results_dir`` (all ``*.json`` there without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", "*.json"], cwd=results_dir, check=True,
                             capture_output=True, text=True).stdout.split()
        files = [results_dir / f for f in out if "/" not in f]
    except (OSError, subprocess.CalledProcessError):
        files = sorted(results_dir.glob("*.json"))
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", help="pytest-benchmark JSON files, one per run "
                        "(default: the committed benchmarks/results/*.json)")
    parser.add_argument("-o", "--output", required=True, help="HTML file to write")
    parser.add_argument("--readme", type=Path, help="also write the headline table into this "
                        "README, between its headline markers")
    parser.add_argument("--include-dirty", action="store_true",
                        help="also show runs of a dirty tree (marked +dirty)")
    parser.add_argument("--open", action="append", default=[], metavar="ANCHOR",
                        help="draw this section expanded (e.g. gpu-h200-megatron-scale-moe-2048x4096-fp32)")
    parser.add_argument("--screenshot", type=Path, metavar="PNG",
                        help="also write a 1280 px wide screenshot of the page (headless Chromium)")
    parser.add_argument("--title", default="stackfix peak-memory benchmarks")
    parser.add_argument("--baselines", type=Path, default=BASELINE_DIR,
                        help="folder of <device_kind>.json baselines (default: the gate's)")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(p) for p in (args.results or committed_result_files())]
        if not runs:
            raise ResultsError("no results files")
        kinds = {k for run in runs for k in run.device_kinds}
        paths = {k: baseline_path_for(k, args.baselines) for k in sorted(kinds)}
        baselines = {k: load_run(p) for k, p in paths.items() if p.is_file()}
        page = render(runs, title=args.title, baselines=baselines,
                      include_dirty=args.include_dirty, open_sections=tuple(args.open))
        if args.readme:
            shown, _ = committed_runs(runs, include_dirty=args.include_dirty)
            table = headline.readme_block(headline.headline_rows(scenario_views(shown, baselines)))
            changed = headline.update_readme(args.readme, table)
            print(f"dashboard: headline table -> {args.readme}{'' if changed else ' (unchanged)'}")
    except (ResultsError, ValueError) as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2
    Path(args.output).write_text(page)
    print(f"dashboard: {len(runs)} run(s) -> {args.output}")
    if args.screenshot:
        chromium = _browser.find_chromium()
        if chromium is None:
            print("dashboard: --screenshot needs Chromium (apt-get install chromium, or "
                  "$STACKFIX_CHROMIUM)", file=sys.stderr)
            return 2
        _browser.screenshot(Path(args.output), args.screenshot, chromium=chromium)
        print(f"dashboard: screenshot -> {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
