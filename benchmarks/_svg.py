"""The dashboard's history chart as inline SVG: one line per strategy over a scenario's runs.

Why hand-written SVG and not a plotting library: the page must open from a file with no
network, and the gate and dashboard run on the standard library alone (CI reads results
without installing torch or anything else). A JavaScript library (Plotly, Vega-Lite, Chart.js)
would have to be inlined into every page -- hundreds of KB to MBs of script for a handful of
small line charts -- and the browser test would then check the library's rendering, not ours;
matplotlib would add a heavy dependency to a stdlib-only tool for static images that cannot
carry the per-point tooltips this chart has. What a library would give here (ticks, labels,
scales) is a few dozen lines below, written to the page's needs:

- x: one position per run of the scenario (no empty slots), each labelled on two lines
  (short commit / date) so labels are distinct, horizontal and never clipped;
- y: spans the data, and at least 2% of its middle value, so a 1% change moves a line by at
  least 40% of the plot height and flat figures stay readable; tick labels carry as many
  decimals as their step needs, so no two read the same;
- runs whose environment changed are marked by a dashed line with the change as its tooltip.

``bar_chart`` draws one run's strategies side by side (a section with a single run, and the step
times, whose history of medians would only chart noise): a bar from zero per strategy, the
spread of its repeats as a whisker, a note (``crashed (SIGSEGV)``) in place of a missing bar,
and a dashed line at the reference (1.0 for a ratio).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#9c755f", "#bab0ac", "#ff9da7")
FONT = 'font-family="system-ui, -apple-system, Segoe UI, sans-serif" font-size="11"'
MIN_RELATIVE_SPAN = 0.02


def y_range(values: Sequence[float]) -> tuple[float, float]:
    """The y axis for ``values``: their span plus 10% each side, at least MIN_RELATIVE_SPAN of
    the middle value, never below zero for figures that are not."""
    lo, hi = min(values), max(values)
    mid = (lo + hi) / 2
    span = max(hi - lo, MIN_RELATIVE_SPAN * abs(mid)) or 1.0
    bottom, top = mid - 0.6 * span, mid + 0.6 * span
    if lo >= 0 > bottom:
        bottom, top = 0.0, top - bottom
    return bottom, top


def nice_ticks(lo: float, hi: float, *, count: int = 4) -> tuple[list[float], int]:
    """Ticks at a round step (1, 2, 2.5 or 5 times a power of ten) inside [lo, hi], and the
    decimals that print each of them exactly, so no two tick labels read the same."""
    raw = (hi - lo) / count if hi > lo else abs(hi) or 1.0
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    ticks = [k * step for k in range(first, first + count + 2) if k * step <= hi + step * 1e-9]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) + (1 if round(step / mag, 6) == 2.5 else 0)
    return ticks, decimals


def line_chart(
    x_labels: Sequence[tuple[str, str]],
    series: Sequence[tuple[str, Sequence[float | None], str]],
    tooltip: Callable[[float], str],
    axis: Callable[[float, float], list[tuple[float, str]]],
    *,
    marks: Sequence[tuple[int, str]] = (),
    width: int = 400,
    height: int = 190,
) -> str:
    """Lines of ``series`` (name, value per run or None, colour) over runs labelled
    ``(commit, date)``. ``tooltip`` formats a
    point; ``axis(lo, hi)`` gives the y ticks as (value, label); ``marks``: (run index, note) drawn as dashed lines with the note as tooltip."""
    left, right, top, bottom = 74, 16, 12, 38
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for _, vs, _ in series for v in vs if v is not None]
    lo, hi = y_range(values) if values else (0.0, 1.0)
    n = max(len(x_labels), 1)

    def px(i: int) -> float:
        return left + plot_w * (i + 0.5) / n

    def py(v: float) -> float:
        return top + plot_h * (1 - (v - lo) / (hi - lo))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" {FONT}>']
    for t, label in axis(lo, hi):
        y = py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#666">{escape(label)}</text>')
    base = top + plot_h
    for i, (commit, date) in enumerate(x_labels):
        x = px(i)
        out.append(f'<text class="xlabel" x="{x:.1f}" y="{base + 14}" text-anchor="middle" fill="#444">'
                   f'{escape(commit)}<tspan x="{x:.1f}" dy="12" fill="#777">{escape(date)}</tspan></text>')
    for i, note in marks:
        x = (px(i - 1) + px(i)) / 2 if i > 0 else px(i)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{base}" stroke="#b35" '
                   f'stroke-dasharray="4 3"><title>environment changed: {escape(note)}</title></line>')
        out.append(f'<text x="{x + 3:.1f}" y="{top + 9}" fill="#b35">env</text>')
    # Equal figures draw the same line: earlier series are drawn wider, so coinciding lines
    # show as nested stripes of every colour instead of the last one drawn.
    for k, (name, vs, colour) in enumerate(series):
        pts = [(i, px(i), py(v), v) for i, v in enumerate(vs) if v is not None]
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for _, x, y, _ in pts)
            w = 2 + 2.2 * (len(series) - 1 - k)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="{w:.1f}" '
                       f'stroke-linejoin="round" stroke-linecap="round"/>')
        for i, x, y, v in pts:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}" stroke="#fff">'
                       f'<title>{escape(name)} @ {escape(" ".join(x_labels[i]))}: '
                       f'{escape(tooltip(v))}</title></circle>')
    out.append("</svg>")
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Bar:
    name: str
    value: float | None  # None: ``note`` is drawn instead
    colour: str
    spread: tuple[float, float] | None = None  # lowest and highest repeat
    note: str = ""


def bar_chart(
    bars: Sequence[Bar],
    tooltip: Callable[[float], str],
    axis: Callable[[float, float], list[tuple[float, str]]],
    *,
    reference: float | None = None,
    width: int = 400,
) -> str:
    """Horizontal bars of ``bars`` from zero (see the module docstring); ``axis(lo, hi)`` gives
    the x ticks as (value, label)."""
    # room for the longest name at the 11 px font (about 6.5 px a character)
    left = max(60, 7 * max((len(b.name) for b in bars), default=0) + 10)
    right, top, row, bottom = 16, 6, 18, 20
    plot_w = width - left - right
    height = top + row * len(bars) + bottom
    values = [v for b in bars for v in (b.value, *(b.spread or ())) if v is not None]
    hi = max([*values, reference or 0.0, 0.0]) * 1.08 or 1.0

    def px(v: float) -> float:
        return left + plot_w * max(v, 0.0) / hi

    out = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" {FONT}>']
    base = top + row * len(bars)
    for t, label in axis(0.0, hi):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{base}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{x:.1f}" y="{base + 14}" text-anchor="middle" fill="#666">{escape(label)}</text>')
    for i, b in enumerate(bars):
        y = top + i * row
        out.append(f'<text x="{left - 6}" y="{y + row - 5}" text-anchor="end" fill="#444">{escape(b.name)}</text>')
        if b.value is None:
            out.append(f'<text x="{left + 4}" y="{y + row - 5}" fill="#c62828">{escape(b.note)}</text>')
            continue
        tip = escape(f"{b.name}: {tooltip(b.value)}" + (
            f" (repeats {tooltip(b.spread[0])} to {tooltip(b.spread[1])})" if b.spread else ""))
        out.append(f'<rect x="{left}" y="{y + 3}" width="{px(b.value) - left:.1f}" height="{row - 6}" '
                   f'fill="{b.colour}"><title>{tip}</title></rect>')
        if b.spread:
            lo, hi_ = px(b.spread[0]), px(b.spread[1])
            mid = y + row / 2
            out.append(f'<path d="M{lo:.1f},{mid - 4:.1f}v8M{lo:.1f},{mid:.1f}H{hi_:.1f}M{hi_:.1f},'
                       f'{mid - 4:.1f}v8" stroke="#222" fill="none"/>')
    if reference is not None:
        x = px(reference)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{base}" stroke="#222" '
                   f'stroke-dasharray="4 3"/>')
    out.append("</svg>")
    return "".join(out)


def legend(entries: Sequence[tuple[str, str]]) -> str:
    """HTML legend: a colour swatch and a name per entry."""
    return "".join(f'<span class="key"><i style="background:{c}"></i>{escape(n)}</span>'
                   for n, c in entries)
