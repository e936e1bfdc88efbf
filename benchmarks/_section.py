"""One scenario's section of the dashboard: the collapsible ``<details>`` with its summary
line, the run it shows (commit, date, environment), a table per figure and a chart.

Contract (for ``section``): the summary line -- visible while collapsed -- holds the section's
main comparison (``benchmarks._compare.main_pair``) in a ``class="delta"`` span. Each table has a
row per strategy of the scenario's family: its value (bytes in MiB, ``crashed (NAME)``, or "not
in this run"), then for additive figures (bytes, FLOPs) its ratio and difference against the
family's "none" (no reclaim, no checkpointing, no sanitizer: ``_compare.reference_title``) and
each verl release present in the family, then its change against the previous run and the
baseline. A step time or time ratio is shown only with the spread of its interleaved repeats
(``benchmarks._spread``: median, lowest and highest), coloured only when every repeat lies on
one side of 1.0, and not at all where the run recorded no repeats; it is compared with no other
run. Each figure gets a chart: its history over the scenario's runs, or -- with a single run,
and for step times -- the latest run's strategies side by side. Notes name environment changes
and moves beyond the gate's tolerance in the same environment. A run older than the last change
to the code it measures carries a badge on the summary line and a paragraph naming the paths and
the commit (``benchmarks._freshness``). Standard library only.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

from benchmarks import _svg
from benchmarks._compare import (
    REFERENCES,
    display_name,
    main_pair,
    note_for,
    reference_rows,
    reference_title,
    versus,
)
from benchmarks._format import fmt
from benchmarks._freshness import Age, Freshness
from benchmarks._results import Row, is_time_metric, unit_of
from benchmarks._spread import Reading, spread_of
from benchmarks._verdict import DEFAULT_TOLERANCE
from benchmarks._views import ENV_KEYS, ScenarioView

# Figures in the order a reader wants them; any other figure follows, sorted.
METRIC_ORDER = ("peak_bytes", "retained_bytes", "after_forward_bytes", "end_of_backward_bytes",
                "step_time_vs_none_ratio", "recompute_flops", "backward_flops", "step_time_ratio",
                "sanitizer_step_time_ratio")
METRIC_TITLES = {
    "peak_bytes": "peak memory",
    "retained_bytes": "kept between steps (the leak)",
    "after_forward_bytes": "live after forward (kept for backward)",
    "end_of_backward_bytes": "live at the end of backward",
    "step_time_vs_none_ratio": "step time / no reclaim (interleaved steps in one child; on the "
                               "H200 beside the refresh's other sessions: the 1% gate runs alone)",
    "recompute_flops": "recompute FLOPs (backward minus backward without AC)",
    "backward_flops": "backward FLOPs",
    "step_time_ratio": "step time, single-threaded / multithreaded backward (interleaved rounds)",
    "step_time_single_threaded_s": "step time, single-threaded backward",
    "step_time_multithreaded_s": "step time, multithreaded backward",
    "sanitizer_step_time_ratio": "step time under the sanitizer(s) / without (interleaved rounds; "
                                 "not gated)",
    "step_time_s": "step time (interleaved rounds)",
    "sanitizer_step_time_min_ratio": "fastest step under the sanitizer(s) / without",
    "step_time_min_s": "step time (fastest of interleaved rounds)",
    # the recompute sanitizer on megatron's models (benchmarks._sanitize_megatron): adjacent steps
    "recompute_step_time_ratio": "step time, values='all' left on / switched off (adjacent "
                                 "steps)",
    "recompute-sampled_step_time_ratio": "step time, values='sampled' left on / switched off "
                                         "(adjacent steps)",
    "recompute-metadata_step_time_ratio": "step time, values='none' left on / switched off "
                                          "(adjacent steps)",
    "recompute-entered_step_time_ratio": "step time, entered with no region watched / no "
                                         "sanitizer (paired steps)",
    "recompute_off_step_s": "step time, values='all' entered and switched off",
    "recompute-sampled_off_step_s": "step time, values='sampled' entered and switched off",
    "recompute-metadata_off_step_s": "step time, values='none' entered and switched off",
    "recompute_first_step_s": "the step that entered values='all' (its first walk)",
    "recompute-sampled_first_step_s": "the step that entered values='sampled' (its first walk)",
    "recompute-metadata_first_step_s": "the step that entered values='none' (its first walk)",
}


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
    diff = "±0" if v.difference == 0 else _text(metric, v.difference, signed=True)
    cls = "good" if v.difference < 0 else "bad" if v.difference > 0 else ""
    return f'<span class="{cls}">{v.ratio:.3f}</span> <span class="note">{escape(diff)}</span>'


def _text(metric: str, value: float | None, *, signed: bool = False) -> str:
    """A table's figure: bytes in MiB (two decimals under 100 MiB, one above; KiB only under
    0.01 MiB) so figures of one scenario share a unit; anything else as ``fmt`` writes it."""
    if value is None or unit_of(metric) != "bytes" or abs(value) < 2**10:
        return fmt(metric, value, signed=signed)
    sign = "+" if signed and value > 0 else ""
    if abs(value) < 0.01 * 2**20:
        return f"{sign}{value / 2**10:.1f} KiB"
    mib = value / 2**20
    return f"{sign}{mib:.2f} MiB" if abs(mib) < 100 else f"{sign}{mib:.1f} MiB"


def _value_cell(row: Row | None, metric: str) -> str:
    if row is None:
        return '<span class="note">not in this run</span>'
    if row.crashed:
        return f'<span class="crashed">crashed ({escape(row.crashed)})</span>'
    return escape(_text(metric, row.metrics.get(metric)))


def _axis(metric: str):
    """Y ticks for ``metric`` as (value, label): round steps in the unit the tables use (bytes:
    MiB), printed with the decimals the step needs."""
    def ticks(lo: float, hi: float) -> list[tuple[float, str]]:
        name, size = "", 1.0
        if unit_of(metric) == "bytes":
            # the tables' unit: MiB from 1 MiB up to 100 GiB
            name, size = next(((f" {n}", s) for n, s in (("GiB", 100 * 2**30), ("MiB", 2**20),
                                                          ("KiB", 2**10)) if max(abs(lo), abs(hi)) >= s),
                              (" B", 1))
            size = 2**30 if name == " GiB" else size
        elif unit_of(metric) == "x":
            name = "x"
        elif unit_of(metric) == "s":
            name, size = " ms", 1e-3
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
    family = _family(view)
    head = (f"{escape(display_name(subject, family))} / {escape(display_name(reference, family))}, "
            f"{escape(metric.removesuffix('_bytes'))}: ")
    if subject in rows and rows[subject].crashed:
        return f'<span class="delta">{head}<span class="crashed">crashed ({escape(rows[subject].crashed)})</span></span>'
    if is_time_metric(metric):  # noise unless read with its spread: no "previous run" either
        # the figure is already a ratio to its reference: name the strategy alone
        head = f"{escape(display_name(subject, family))}, {escape(metric)}: "
        return f'<span class="delta">{head}{_time_cell(rows.get(subject), metric)}</span>'
    v = versus(rows.get(subject), rows.get(reference), metric)
    text = head + _versus_cell(metric, v)
    if view.previous is None:
        text += ' <span class="note">· the first committed run of this scenario</span>'
    else:
        prev, now = view.previous.rows.get(subject), rows.get(subject)
        change = _relative(now.metrics.get(metric) if now else None,
                           prev.metrics.get(metric) if prev else None)
        text += f' <span class="note">· vs previous run {escape(change)}</span>'
    return f'<span class="delta">{text}</span>'


READING_CLASSES = {Reading.BELOW: "good", Reading.ABOVE: "bad"}


def _time_cell(row: Row | None, metric: str) -> str:
    """A step time or ratio with the spread of its repeats; a ratio coloured only when every
    repeat lies on one side of 1.0 (``benchmarks._spread``); without repeats, not shown."""
    if row is None:
        return '<span class="note">not in this run</span>'
    if row.crashed:
        return f'<span class="crashed">crashed ({escape(row.crashed)})</span>'
    spread = spread_of(row.repeats, metric)
    if spread is None:
        return '<span class="note">not shown: no repeats recorded (a median alone is noise)</span>'

    def text(v: float) -> str:
        return escape(fmt(metric, v))

    median = text(spread.median)
    if unit_of(metric) != "x":
        return f"{median} [{text(spread.low)}-{text(spread.high)}], {spread.count} repeats"
    reading = spread.reading(1.0)
    if reading in READING_CLASSES:
        median = f'<span class="{READING_CLASSES[reading]}">{median}</span>'
    # Say what the ratio compares, and for a range across 1.0 on which side its median lies:
    # "within noise" next to a 3x median read as "no cost".
    said = str(reading)
    if reading is Reading.SPANS and spread.low == spread.high:
        said = "1 in every repeat"  # the reference itself
    elif reading is Reading.SPANS and spread.median != 1:
        side = "above" if spread.median > 1 else "below"
        said = f"median {side} 1, but {said}: not {side} it in every repeat"
    return (f'{median} [{text(spread.low)}-{text(spread.high)}] '
            f'<span class="note">({escape(_compared(metric))})</span>, {spread.count} repeats · '
            f'<span class="note">{escape(said)}</span>')


def _compared(metric: str) -> str:
    """What a ratio figure divides by what: its title up to the parenthesis."""
    return METRIC_TITLES.get(metric, metric).split(" (", 1)[0]


def _family(view: ScenarioView) -> str:
    return view.scenario.split("/")[0]


def _time_table(view: ScenarioView, metric: str, colours: dict[str, str]) -> str:
    latest = view.latest.rows
    out = ['<table><tr><th>strategy</th><th>median of the interleaved repeats [lowest-highest]'
           '</th></tr>']
    for s in view.strategies:
        row = latest.get(s)
        if row is not None and not row.crashed and metric not in row.metrics:
            continue
        out.append(f'<tr><td title="{escape(note_for(s))}">{_key(s, colours, _family(view))}</td>'
                   f'<td>{_time_cell(row, metric)}</td></tr>')
    out.append("</table>")
    return "".join(out)


def _key(strategy: str, colours: dict[str, str], family: str) -> str:
    return (f'<span class="key"><i style="background:{colours.get(strategy, "#999")}"></i>'
            f'{escape(display_name(strategy, family))}</span>')


def _figure_table(view: ScenarioView, metric: str, colours: dict[str, str]) -> str:
    if is_time_metric(metric):
        return _time_table(view, metric, colours)
    latest = view.latest.rows
    # A ratio or a time is compared with its own previous run and baseline only: a step-time
    # ratio already is "against no reclaim".
    refs = [(title, row) for title, row in reference_rows(latest)
            if any(n in view.strategies for n in dict(REFERENCES)[title])
            and unit_of(metric) in ("bytes", "FLOPs")]
    previous = view.previous.rows if view.previous else {}
    family = view.scenario.split("/")[0]
    head = "".join(f"<th>vs {escape(reference_title(t, family))}</th>" for t, _ in refs)
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
        out.append(f'<tr><td title="{escape(note_for(s))}">{_key(s, colours, _family(view))}</td>'
                   f'<td>{_value_cell(row, metric)}</td>'
                   + "".join(f"<td>{c}</td>" for c in cells)
                   + f"<td>{escape(_relative(now, prev))}</td><td>{escape(_relative(now, base))}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _bars(view: ScenarioView, metric: str, colours: dict[str, str]) -> str:
    """The latest run's strategies side by side; a time figure's bars only where it has
    repeats (their median, the spread as a whisker)."""
    bars = []

    def name(strategy: str) -> str:
        return display_name(strategy, _family(view))

    for s in view.strategies:
        row = view.latest.rows.get(s)
        colour = colours.get(s, "#999")
        if row is None or row.crashed:
            bars.append(_svg.Bar(name(s), None, colour, note=f"crashed ({row.crashed})" if row else
                                 "not in this run"))
        elif is_time_metric(metric):
            spread = spread_of(row.repeats, metric)
            if spread is not None:
                bars.append(_svg.Bar(name(s), spread.median, colour, (spread.low, spread.high)))
        elif metric in row.metrics:
            bars.append(_svg.Bar(name(s), row.metrics[metric], colour))
    if not any(b.value is not None for b in bars):
        return ""
    return _svg.bar_chart(bars, lambda v: fmt(metric, v), _axis(metric),
                          reference=1.0 if unit_of(metric) == "x" else None)


def _history(view: ScenarioView, metric: str, colours: dict[str, str]) -> str:
    if is_time_metric(metric):
        return _bars(view, metric, colours)  # a history of medians would chart noise
    if len(view.history) < 2:
        return (_bars(view, metric, colours)
                + '<p class="note">history: one committed run of this scenario so far.</p>')
    labels = [tuple(p.label.split(" ", 1)) if " " in p.label else (p.label, "") for p in view.history]
    series = [(display_name(s, _family(view)), [p.rows[s].metrics.get(metric) if s in p.rows else None for p in view.history],
               colours.get(s, "#999")) for s in view.strategies]
    series = [s for s in series if any(v is not None for v in s[1])]
    return _svg.line_chart(labels, series, lambda v: fmt(metric, v), _axis(metric),
                           marks=view.env_changes)


def _freshness_html(freshness: Freshness | None) -> tuple[str, str]:
    """(the summary line's badge, the paragraph under it) for the run's freshness."""
    if freshness is None:
        return "", ""
    if not freshness.stale:
        return "", f'<p class="meta">{escape(freshness.note())}.</p>'
    tail = (f": its figures may not describe the code at {freshness.head[:8]}"
            if freshness.age is Age.OLDER and freshness.head else "")
    return (f' <span class="stale">{escape(str(freshness.age))}</span>',
            f'<p class="stale">{escape(freshness.note() + tail)}.</p>')


def section(view: ScenarioView, colours: dict[str, str], *, open_: bool = False,
            freshness: Freshness | None = None,
            superseded_by: tuple[str, str] | None = None) -> str:
    """One scenario on one device kind (see the module docstring); ``freshness``: whether its
    run is older than the code it measures (``benchmarks._freshness``); ``superseded_by``: the
    card and run label of a newer run of the scenario on another GPU card
    (``benchmarks._views.superseded``)."""
    latest = view.latest
    # a time figure is read in the latest run alone: one it does not have gets no table
    metrics = sorted((m for m in view.metrics if not is_time_metric(m)
                      or any(m in r.metrics for r in latest.rows.values())), key=_metric_sort_key)
    run = latest.run
    dirty = ' <span class="dirty">dirty tree</span>' if run.dirty else ""
    badge, age_note = _freshness_html(freshness)
    if superseded_by is not None:
        card, label = superseded_by
        badge = ' <span class="meta">superseded</span>' + badge
        age_note = (f'<p class="meta">superseded by the newer run of this scenario on '
                    f'<a href="#{anchor(card, view.scenario)}">{escape(card)}</a> '
                    f'({escape(label)}).</p>' + age_note)
    prev = view.previous
    out = [f'<details class="scn" id="{anchor(view.kind, view.scenario)}"{" open" if open_ else ""}>'
           f'<summary><b>{escape(view.scenario)}</b> <span class="meta">({escape(view.kind)}; '
           f'latest {escape(latest.label)})</span>{dirty}{badge}{_summary_delta(view, metrics)}</summary>',
           age_note,
           f'<p class="meta">latest run of this scenario on {escape(view.kind)}: commit '
           f'<b>{escape(run.commit[:12] or "unknown (no git)")}</b>{dirty}, {escape(run.date or "no date")} UTC'
           f' · {_env_text(latest) or "environment not recorded"} · file {escape(Path(run.path).name)}'
           f'<br>previous: {escape(prev.label) if prev else "none"} · baseline: '
           f'{"benchmarks/baselines/" + escape(view.kind) + ".json" if view.baseline else "none"} · '
           f'{len(view.history)} run(s) in the history</p>']
    for i, note in view.env_changes:
        out.append(f'<p class="note">environment changed at {escape(view.history[i].label)}: '
                   f'{escape(note)}</p>')
    for i, note in view.code_changes(DEFAULT_TOLERANCE):
        out.append(f'<p class="note">at {escape(view.history[i].label)}: {escape(note)}</p>')
    for metric in metrics:
        out.append(f'<h3>{escape(METRIC_TITLES.get(metric, metric))} '
                   f'<span class="meta">[{escape(metric)}]</span></h3><div class="fig">'
                   f'{_figure_table(view, metric, colours)}{_history(view, metric, colours)}</div>')
    out.append("</details>")
    return "\n".join(out)
