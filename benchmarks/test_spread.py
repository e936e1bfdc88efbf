"""Step times are measured interleaved and repeated, every repeat recorded; a ratio is read as
a result only when the spread of its repeats lies on one side of 1.0."""

from __future__ import annotations

import pytest

from benchmarks import _spread
from benchmarks._spread import Reading, Spread

pytestmark = pytest.mark.cpu


def test_strategies_are_interleaved_and_every_repeat_is_recorded():
    order = []
    clock = iter(range(1, 100))

    def run_one(name):
        order.append(name)
        return float(next(clock))

    times = _spread.interleaved(("a", "b", "c"), run_one, repeats=4)
    # forward, then backward, so no strategy always runs right after the same one
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert times == {"a": [1.0, 6.0, 7.0, 12.0], "b": [2.0, 5.0, 8.0, 11.0],
                     "c": [3.0, 4.0, 9.0, 10.0]}
    ratios = _spread.ratios_to(times, "a")  # repeat by repeat: a drift over the run cancels
    assert ratios["a"] == [1.0] * 4 and ratios["c"] == [3 / 1, 4 / 6, 9 / 7, 10 / 12]


def test_a_spread_is_the_median_and_the_range_of_its_repeats():
    s = Spread.of([1.2, 0.9, 1.0, 1.1, 0.8])
    assert (s.median, s.low, s.high, s.count) == (1.0, 0.8, 1.2, 5)
    assert s.text(lambda v: f"{v:.2f}") == "1.00 [0.80-1.20], 5 repeats"


@pytest.mark.parametrize("values, reading", [
    ([0.7, 0.8, 0.9, 0.95, 1.02], Reading.SPANS),  # the spread covers 1.0: not a gain
    ([0.7, 0.8, 0.9, 0.95, 0.99], Reading.BELOW),
    ([1.01, 1.2, 1.3, 1.4, 1.5], Reading.ABOVE),
    ([0.5, 0.5, 0.5], Reading.TOO_FEW),  # fewer than MIN_REPEATS: no spread to judge by
])
def test_a_ratio_reads_as_a_result_only_when_its_spread_is_on_one_side(values, reading):
    assert Spread.of(values).reading(1.0) is reading


def test_no_repeats_no_spread():
    assert _spread.spread_of({}, "step_time_ratio") is None
    assert _spread.spread_of({"step_time_ratio": (1.0, 1.1, 0.9, 1.0, 1.0)},
                             "step_time_ratio").count == 5
