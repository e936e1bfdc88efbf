"""Step times on a shared machine are noise unless read with their spread: the strategies run
interleaved and repeated, every repeat is recorded (``<figure>_repeats`` in ``extra_info``), and
a ratio counts as a result only when the spread of its repeats lies on one side of 1.0.

- ``interleaved(names, run_one, repeats)``: each repeat runs every strategy once, in the given
  order on even repeats and reversed on odd ones (no strategy always follows the same one);
  returns each strategy's times, one per repeat.
- ``ratios_to(times, reference)``: per strategy, repeat by repeat, its time over the
  reference's in the same repeat (a clock or load drift over the run cancels out).
- ``Spread``: the median of the repeats and their range (lowest to highest). ``reading``: BELOW
  or ABOVE the reference only when the whole range is; SPANS when the range covers it; TOO_FEW
  under ``MIN_REPEATS`` repeats (no spread to judge by).
Standard library only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

MIN_REPEATS = 5


def interleaved(names: Sequence[str], run_one: Callable[[str], float],
                repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(run_one(name))
    return times


def ratios_to(times: Mapping[str, Sequence[float]], reference: str) -> dict[str, list[float]]:
    ref = times[reference]
    return {name: [t / r for t, r in zip(ts, ref, strict=True)] for name, ts in times.items()}


class Reading(StrEnum):
    BELOW = "below 1 in every repeat"
    ABOVE = "above 1 in every repeat"
    SPANS = "the range spans 1.0"  # lowest <= reference <= highest: no side in every repeat
    TOO_FEW = "too few repeats"


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def reading(self, reference: float = 1.0) -> Reading:
        if self.count < MIN_REPEATS:
            return Reading.TOO_FEW
        if self.high < reference:
            return Reading.BELOW
        if self.low > reference:
            return Reading.ABOVE
        return Reading.SPANS

    def text(self, fmt: Callable[[float], str]) -> str:
        return f"{fmt(self.median)} [{fmt(self.low)}-{fmt(self.high)}], {self.count} repeats"


def spread_of(repeats: Mapping[str, Sequence[float]], metric: str) -> Spread | None:
    """The spread of ``metric``'s recorded repeats (a Row's ``repeats``), None without any."""
    values = repeats.get(metric)
    return Spread.of(values) if values else None
