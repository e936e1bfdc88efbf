"""Build the static HTML dashboard (and the README's headline table) from benchmark results.

    python -m benchmarks.dashboard [RESULTS.json ...] -o benchmarks/results/dashboard.html
                                   [--readme README.md] [--screenshot PNG] [--include-dirty]
                                   [--open ANCHOR] [--baselines DIR]

Without result files it reads the committed ones (``benchmarks/results/runs/*.json`` that git
tracks). Contract of the page:

- Runs of a dirty tree are left out (counted at the top) unless ``--include-dirty``; then
  they are labelled ``+dirty`` (``benchmarks._views``).
- A summary table of the headline cells (``benchmarks.headline``) comes first; ``--readme``
  writes the README's shorter table of the same rows (one size per model) between its markers, and ``--screenshot`` a PNG of
  the whole page, as tall as it is (headless Chromium, ``benchmarks._browser``), in the same
  command.
- One collapsible section per device kind and scenario, showing the latest run *of that
  scenario on that kind*, its strategies named as the headline names them ("verl 0.8.0", not
  ``unsafe``: ``_compare.display_name``). Its one-line summary (visible while collapsed) gives
  ours against no reclaim and the change since the previous run (or that it is the first). Open, it gives per figure every strategy's
  value, its ratio and difference against the family's "none" and each verl release
  (``benchmarks._compare``), its change against the previous run and the baseline
  (``baselines/<kind>.json``, the gate's), the commit, date and environment of the run, and a
  chart: the figure's history over the scenario's runs with environment changes noted, or the
  run's strategies side by side. Step times only with the spread of their repeats
  (``benchmarks._section``).
- A scenario's section on a GPU card whose latest run is older than that scenario's latest run
  on another card is drawn last, under "superseded", naming the section that replaces it
  (``benchmarks._views.superseded``); the headline reads the newer card's.
- A section (and a headline row) whose run is older than the last change to the code it
  measures says so, against the checkout the page is built from (``benchmarks._freshness``).
- A strategy that crashed is shown as ``crashed (NAME)``; one the run did not have, as
  "not in this run".
- Self-contained: inline CSS and SVG (``benchmarks._svg`` says why no plotting library), no
  script, no network. Readable at 1280 px.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from benchmarks import _browser, _svg, headline
from benchmarks._baseline import BASELINE_DIR, baseline_path_for
from benchmarks._compare import DISPLAY_NAMES, note_for
from benchmarks._freshness import History, freshness
from benchmarks._published import RESULTS_DIR, committed_result_files
from benchmarks._results import ResultsError, Run, load_run
from benchmarks._section import anchor, section
from benchmarks._views import ScenarioView, committed_runs, scenario_views, superseded

__all__ = ["RESULTS_DIR", "committed_result_files", "main", "render", "summary_table"]
CSS = """
.names td{text-align:left;white-space:normal;padding:1px 8px}
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
.summary td:last-child{white-space:normal;text-align:left} .nowrap{white-space:nowrap}
details.scn{border:1px solid #e4e4e4;border-radius:6px;margin:4px 0;padding:0 10px}
details.scn>summary{cursor:pointer;padding:5px 0;font-size:13.5px}
details.scn[open]>summary{border-bottom:1px solid #eee;margin-bottom:6px}
.delta{font-weight:600;margin-left:8px} .good{color:#1a7f37} .bad{color:#c62828}
.crashed{color:#c62828;font-weight:600} .dirty{color:#b35;font-weight:600}
.stale{color:#c62828;font-weight:600}
.fig{display:flex;flex-wrap:wrap;gap:0 24px;align-items:flex-start;border-top:1px solid #f0f0f0}
.key{display:inline-block;margin-right:12px;font-size:12px} .key i{display:inline-block;
width:10px;height:10px;border-radius:2px;margin-right:4px} h3{font-size:13px;margin:10px 0 2px}
"""


def summary_table(rows: list[headline.HeadlineRow]) -> str:
    """Every headline cell, one row per strategy (the README shows one size per model), each
    linked to its section."""
    head = "".join(f"<th>{escape(c)}</th>" for c in headline.COLUMNS)
    out = [f'<table class="summary" id="headline"><tr>{head}</tr>']
    for row in rows:
        cells = [escape(c) for c in headline.cells_of(row)]
        if row.first:
            cells[0] = (f'<a href="#{anchor(*row.anchor_key)}" '
                        f'title="{escape(row.cell.scenario)}">{cells[0]}</a>')
        cells = [f'<span class="crashed">{c}</span>' if c.startswith("crashed") else c for c in cells]
        if row.first and row.run_label and row.freshness is not None and row.freshness.stale:
            # the paths and the commit are the section's (and the tooltip's): the table stays narrow
            cells[-1] = (f'<span class="nowrap">{escape(row.run_label)}</span><br><span class="stale" title="'
                         f'{escape(row.freshness.note())}">{escape(str(row.freshness.age))}</span>')

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
           open_sections: tuple[str, ...] = (), history: History | None = None) -> str:
    """The page for ``runs`` (any order); ``baselines``: device kind -> baseline run;
    ``open_sections``: anchors of sections to draw expanded; ``history``: the checkout whose
    code each section's run is judged against (None: not judged)."""
    if not runs:
        raise ValueError("render needs at least one run")
    shown, left_out = committed_runs(runs, include_dirty=include_dirty)
    if not shown:
        raise ValueError(f"all {len(runs)} run(s) come from a dirty tree; pass include_dirty")
    views = scenario_views(shown, baselines)
    sections = [anchor(v.kind, v.scenario) for v in views]
    if unknown := [a for a in open_sections if a not in sections]:
        raise ValueError(f"--open {unknown[0]!r}: no such section; the sections: "
                         f"{', '.join(sections)}")
    colours = _strategy_colours(views)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    dirty_note = (f"; {len(left_out)} run(s) of a dirty tree left out (--include-dirty shows them, "
                  f"marked)" if left_out else "")
    if include_dirty and any(r.dirty for r in shown):
        dirty_note = '; <span class="dirty">runs of a dirty tree included, marked +dirty</span>'
    # a section shows a verl release's reclaim by the release's name: both names here
    strategies = "".join(
        f"<tr><td>{escape(DISPLAY_NAMES[s] + ' (' + s + ')' if s in DISPLAY_NAMES else s)}</td>"
        f"<td>{escape(note_for(s))}</td></tr>" for s in colours if note_for(s))
    age = ""
    if history is not None:
        age = (f' Each run is judged against the code as of {escape(history.head()[:8] or "?")}: '
               f'a section whose run measured code that has changed since '
               f'(<code>git diff RUN HEAD -- PATHS</code> not empty) says so, '
               f'<span class="stale">in red</span>.')
    head = (f'<h1>{escape(title)}</h1><p class="meta">{len(shown)} committed run(s){dirty_note}; '
            f'generated {generated}. Bytes: MemTracker on CPU, CUDA max_memory_allocated on GPU; '
            f'smaller is better. Each section shows the latest run of that scenario on that device '
            f'kind; ratios are value / reference, differences value - reference.{age}</p>'
            f'<h2>Headline figures (MiB)</h2>'
            f'{summary_table(headline.headline_rows(views, history=history))}'
            f'<details open><summary class="meta">what the strategy names mean</summary>'
            f'<table class="names">{strategies}</table></details>{_nav(views)}')
    body = []
    old = superseded(views)

    def drawn(v: ScenarioView) -> str:
        return section(v, colours, open_=anchor(v.kind, v.scenario) in open_sections,
                       freshness=None if history is None else freshness(
                           v.latest.run.commit, v.scenario.split("/")[0], history),
                       superseded_by=old.get((v.kind, v.scenario)))

    for kind in sorted({v.kind for v in views if (v.kind, v.scenario) not in old}):
        body.append(f'<h2 id="{anchor(kind, "")}">{escape(kind)}</h2>')
        body += [drawn(v) for v in views if v.kind == kind and (v.kind, v.scenario) not in old]
    if old:
        body.append('<h2 id="superseded">Superseded: a newer run of the same scenario on another '
                    'GPU card replaces these</h2>')
        body += [drawn(v) for v in views if (v.kind, v.scenario) in old]
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{escape(title)}</title><style>{CSS}</style></head><body>{head}\n'
            + "\n".join(body) + "</body></html>\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", help="pytest-benchmark JSON files, one per run "
                        "(default: the committed benchmarks/results/runs/*.json)")
    parser.add_argument("-o", "--output", required=True, help="HTML file to write")
    parser.add_argument("--readme", type=Path, help="also write the headline table into this "
                        "README, between its headline markers")
    parser.add_argument("--include-dirty", action="store_true",
                        help="also show runs of a dirty tree (marked +dirty)")
    parser.add_argument("--open", action="append", default=[], metavar="ANCHOR",
                        help="draw this section expanded (e.g. gpu-h200-megatron-scale-moe-2048x4096-fp32)")
    parser.add_argument("--screenshot", type=Path, metavar="PNG",
                        help="also write a screenshot of the whole page, 1280 px wide (headless Chromium)")
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
        history = History()
        page = render(runs, title=args.title, baselines=baselines,
                      include_dirty=args.include_dirty, open_sections=tuple(args.open),
                      history=history)
        if args.readme:
            table = headline.readme_table(runs, include_dirty=args.include_dirty, history=history)
            changed = headline.update_readme(args.readme, table)
            text = args.readme.read_text()
            compat = headline.with_compat_summary(text, history=history)
            if compat != text:
                args.readme.write_text(compat)
                changed = True
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
        height = _browser.screenshot(Path(args.output), args.screenshot, chromium=chromium)
        cut = " (the page is taller: cut there)" if height == _browser.MAX_HEIGHT else ""
        print(f"dashboard: screenshot 1280x{height}{cut} -> {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
