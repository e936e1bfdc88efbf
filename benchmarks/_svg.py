"""Two inline-SVG charts for the dashboard -- horizontal bars and lines over runs -- written by
hand so the page needs no plotting library, no network and no script (standard library only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#9c755f", "#bab0ac", "#ff9da7")
FONT = 'font-family="system-ui, -apple-system, Segoe UI, sans-serif" font-size="12"'


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def bar_chart(
    bars: Sequence[tuple[str, float | None, str]],
    fmt: Callable[[float], str],
    *,
    width: int = 520,
    label_width: int = 150,
) -> str:
    """One horizontal bar per (label, value, colour); value None draws "n/a"."""
    bar_h, gap, top, bottom = 20, 8, 8, 24
    height = top + len(bars) * (bar_h + gap) + bottom
    plot_w = width - label_width - 90
    vmax = max((v for _, v, _ in bars if v is not None), default=0) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" {FONT}>']
    axis_y = top + len(bars) * (bar_h + gap)
    for t in _ticks(0, vmax, 2):  # three labels: long unit strings must not collide
        x = label_width + plot_w * t / vmax
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{axis_y}" stroke="#e3e3e3"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 15}" text-anchor="middle" fill="#777">{escape(fmt(t))}</text>')
    for i, (label, value, colour) in enumerate(bars):
        y = top + i * (bar_h + gap)
        out.append(f'<text x="{label_width - 8}" y="{y + bar_h * 0.7:.1f}" text-anchor="end" '
                   f'fill="#222">{escape(label)}</text>')
        if value is None:
            out.append(f'<text x="{label_width + 4}" y="{y + bar_h * 0.7:.1f}" fill="#999" '
                       f'font-style="italic">n/a</text>')
            continue
        w = max(plot_w * value / vmax, 1)
        out.append(f'<rect x="{label_width}" y="{y}" width="{w:.1f}" height="{bar_h}" rx="2" '
                   f'fill="{colour}"><title>{escape(label)}: {escape(fmt(value))}</title></rect>')
        out.append(f'<text x="{label_width + w + 5:.1f}" y="{y + bar_h * 0.7:.1f}" '
                   f'fill="#222">{escape(fmt(value))}</text>')
    out.append("</svg>")
    return "".join(out)


def line_chart(
    x_labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None], str]],
    fmt: Callable[[float], str],
    *,
    width: int = 520,
    height: int = 230,
) -> str:
    """One line per (name, values by run, colour) over the runs ``x_labels``; gaps for None.
    The y axis spans the data (not from zero): the point is to see a figure move."""
    left, right, top, bottom = 104, 16, 10, 80
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for _, vs, _ in series for v in vs if v is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (hi - lo) * 0.1 or (abs(hi) * 0.05 or 1.0)
    lo, hi = (max(lo - pad, 0.0) if lo >= 0 else lo - pad), hi + pad
    n = len(x_labels)

    def px(i):
        return left + (plot_w * (i + 0.5) / n)

    def py(v):
        return top + plot_h * (1 - (v - lo) / (hi - lo))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" {FONT}>']
    for t in _ticks(lo, hi):
        y = py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#777">{escape(fmt(t))}</text>')
    for i, label in enumerate(x_labels):
        x = px(i)
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 14}" text-anchor="end" fill="#555" '
                   f'transform="rotate(-30 {x:.1f} {top + plot_h + 14})">{escape(label)}</text>')
    # Strategies with equal figures draw the same line: earlier series are drawn first and
    # wider, so coinciding lines show as nested stripes of every colour instead of the last one.
    for k, (name, vs, colour) in enumerate(series):
        pts = [(px(i), py(v), v) for i, v in enumerate(vs) if v is not None]
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts)
            w = 2 + 2.5 * (len(series) - 1 - k)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="{w}" '
                       f'stroke-linejoin="round" stroke-linecap="round"/>')
        for (x, y, v), label in zip(pts, [x_labels[i] for i, v in enumerate(vs) if v is not None],
                                    strict=True):
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}" stroke="#fff">'
                       f'<title>{escape(name)} @ {escape(label)}: {escape(fmt(v))}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def legend(entries: Sequence[tuple[str, str]]) -> str:
    """HTML legend: a colour swatch and a name per entry."""
    return "".join(f'<span class="key"><i style="background:{c}"></i>{escape(n)}</span>'
                   for n, c in entries)
