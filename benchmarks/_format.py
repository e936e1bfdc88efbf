"""Human-readable figures for the gate's table and the dashboard (standard library only)."""

from __future__ import annotations

import math

from benchmarks._results import unit_of

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def fmt(metric: str, value: float | None, *, signed: bool = False) -> str:
    """``value`` of ``metric`` with its unit: bytes in KiB/MiB/GiB, FLOPs in GFLOP..."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    sign = "+" if signed and value > 0 else ""
    unit = unit_of(metric)
    if unit == "bytes":
        for name, size in _BINARY:
            if abs(value) >= size:
                return f"{sign}{value / size:.2f} {name}"
        return f"{sign}{value:.0f} B"
    if unit == "FLOPs":
        for name, size in _DECIMAL:
            if abs(value) >= size:
                return f"{sign}{value / size:.2f} {name}FLOP"
        return f"{sign}{value:.0f} FLOP"
    if unit == "x":
        return f"{sign}{value:.3f}x"
    if unit == "s":
        return f"{sign}{value * 1e3:.1f} ms"
    return f"{sign}{value:.4g}"


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.4f}"
