"""``CheckpointWithoutOutput``'s output discard: peak, kept (after forward) and end-of-backward
bytes of none / main-retain (Megatron-LM main's ``retain_input_tensors``) / ours on a
fused-residual norm under selective recompute (benchmarks/_output_discard.py has the
scenarios), plus the relations between the strategies."""

from __future__ import annotations

import pytest

from benchmarks import _output_discard
from benchmarks._bench import DEVICE_PARAMS, record
from benchmarks._reclaim import megatron_unavailable
from repro import Skipped

SCENARIO = "output-discard/{}"


def _figures(book, scenario: str, strategy: str, device: str) -> dict:
    try:
        return book.get(("output-discard", scenario, strategy, device),
                        lambda: _output_discard.figures_in_child(scenario, strategy, device))
    except Skipped as skip:
        pytest.skip(str(skip))


@pytest.fixture
def cell_figures(request, figure_book):
    """The cell's figures, measured before the ``benchmark`` fixture exists: a cell that cannot
    run here skips without leaving pytest-benchmark an empty benchmark."""
    reason = megatron_unavailable()
    if reason:
        pytest.skip(reason)
    p = request.node.callspec.params
    return _figures(figure_book, p["scenario"], p["strategy"], p["device"])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("strategy", _output_discard.STRATEGIES)
@pytest.mark.parametrize("scenario", _output_discard.SCENARIOS)
def test_output_discard_memory(cell_figures, benchmark, scenario, strategy, device):
    # The figures that matter are bytes; the timing is a formality of pytest-benchmark.
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    record(benchmark, scenario=SCENARIO.format(scenario), strategy=strategy, device=device,
           figures=cell_figures)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("scenario", _output_discard.SCENARIOS)
def test_ours_costs_what_main_retain_costs_and_saves_against_none(figure_book, scenario, device):
    """On the fused-residual norm the two keep the same outputs (the residual): the same bytes,
    to the byte; both keep less for backward than no discard (the normed outputs are freed)."""
    if megatron_unavailable():
        pytest.skip(megatron_unavailable())
    ours = _figures(figure_book, scenario, "ours", device)
    main = _figures(figure_book, scenario, "main-retain", device)
    none = _figures(figure_book, scenario, "none", device)
    assert ours == main
    assert ours["after_forward_bytes"] < none["after_forward_bytes"]
    assert ours["peak_bytes"] <= none["peak_bytes"]
