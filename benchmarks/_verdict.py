"""What the gate makes of one figure against a reference figure (the baseline's, or the one the
README and the dashboard show). Standard library only.

A memory figure (``*_bytes``) that moved beyond the tolerance either way no longer describes
the code: it grew (``REGRESSED``) or shrank (``SHRANK``), and both fail the gate until the
reference is refreshed in the same change. Other figures (FLOPs, time ratios) are ``INFO``:
FLOPs are pinned by the benchmarks' own assertions, times are noisy.

Tolerance (``DEFAULT_TOLERANCE``, relative): the memory figures are not noisy -- MemTracker
counts exact storage bytes, and the caching allocator's counters are identical between runs of
one program on one software stack. So the tolerance is not there to absorb noise but allocator
and kernel drift between torch patch releases, and it must stay well below the smallest effect
the benchmarks exist to show: ``python -m benchmarks.gate --explain`` prints the smallest gap
between two strategies of one scenario in the baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from benchmarks._results import Row, is_memory_metric

DEFAULT_TOLERANCE = 0.005


class Verdict(StrEnum):
    OK = "ok"
    GREW = "REGRESSED"
    SHRANK = "SHRANK"
    INFO = "info"  # not gated (FLOPs, times)
    NO_BASELINE = "NO BASELINE"
    NOT_RUN = "NOT RUN"

    @property
    def moved(self) -> bool:
        return self in (Verdict.GREW, Verdict.SHRANK)

    @property
    def unmatched(self) -> bool:
        return self in (Verdict.NO_BASELINE, Verdict.NOT_RUN)


Reference = Literal["baseline", "published"]


@dataclass(frozen=True, slots=True)
class Comparison:
    """One figure of one benchmark, reference vs now, and what the gate makes of it;
    ``reference_commit`` the commit that measured the reference figure ("" if unknown),
    ``reference_file`` the file it was read from."""

    device_kind: str
    scenario: str
    strategy: str
    metric: str
    baseline: float | None
    now: float | None
    verdict: Verdict
    reference: Reference = "baseline"
    reference_commit: str = ""
    reference_file: str = ""

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


def judge(metric: str, baseline: float, now: float, tolerance: float) -> Verdict:
    if not is_memory_metric(metric):
        return Verdict.INFO
    if now > baseline * (1 + tolerance):
        return Verdict.GREW
    if now < baseline * (1 - tolerance):
        return Verdict.SHRANK
    return Verdict.OK


def compare(
    rows: list[Row], reference_rows: list[Row], *, tolerance: float = DEFAULT_TOLERANCE,
    reference: Reference = "baseline", reference_file: str = "",
) -> list[Comparison]:
    """Every figure of ``rows`` against ``reference_rows`` (matched on device kind, scenario,
    strategy). Against the baseline each side's missing memory figures are NO BASELINE / NOT
    RUN; against the published figures only the figures both have are compared."""
    tolerance = check_tolerance(tolerance)
    base = {row.key: row for row in reference_rows}
    out: list[Comparison] = []
    for row in rows:
        ref = base.get(row.key)
        for metric, now in sorted(row.metrics.items()):
            if ref is None or metric not in ref.metrics:
                if reference == "baseline":
                    verdict = Verdict.NO_BASELINE if is_memory_metric(metric) else Verdict.INFO
                    out.append(Comparison(*row.key, metric, None, now, verdict))
                continue
            then = ref.metrics[metric]
            out.append(Comparison(*row.key, metric, then, now, judge(metric, then, now, tolerance),
                                  reference, ref.commit, reference_file or ref.source))
    if reference == "baseline":
        ran = {(c.device_kind, c.scenario, c.strategy, c.metric) for c in out}
        for ref in reference_rows:
            for metric, then in sorted(ref.metrics.items()):
                if is_memory_metric(metric) and (*ref.key, metric) not in ran:
                    out.append(Comparison(*ref.key, metric, then, None, Verdict.NOT_RUN,
                                          reference, ref.commit, ref.source))
    return out
