"""Recompute reclaim: peak and end-of-backward bytes of none / unsafe (verl 0.8.0) / mtp-skip
(verl 0.9.1) / ours on a Megatron-like stack of megatron-core checkpoints, with and without a
chunked MTP-like input (benchmarks/_reclaim.py has the scenario), plus the relations between the
strategies."""

from __future__ import annotations

import pytest

from benchmarks import _reclaim
from benchmarks._bench import DEVICE_PARAMS, record
from repro import Skipped

SCENARIO = "recompute-reclaim/{}"


@pytest.fixture(autouse=True)
def _megatron_or_skip():
    reason = _reclaim.megatron_unavailable()
    if reason:
        pytest.skip(reason)


def reclaim_figures(variant: str, strategy: str, device: str) -> dict:
    """Measured in a child interpreter (one verl release per process); skipped with the reason
    where the child could not run."""
    try:
        return _reclaim.figures_in_child(variant, strategy, device)
    except Skipped as skip:
        pytest.skip(str(skip))


def book_figures(book, variant, strategy, device) -> dict:
    return book.get(("reclaim", variant, strategy, device),
                    lambda: reclaim_figures(variant, strategy, device))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("strategy", _reclaim.STRATEGIES)
@pytest.mark.parametrize("variant", _reclaim.VARIANTS)
def test_reclaim_memory(benchmark, figure_book, variant, strategy, device):
    """The cell's figures, or for a cell of ``_reclaim.CRASHES`` what ended its child
    (``crashed``: the dashboard shows it as crashed, the gate has no figure to compare)."""
    got = {}
    # The time is the child's whole run (start-up, warm-up step, measured step): the figures
    # that matter here are bytes.
    benchmark.pedantic(lambda: got.update(reclaim_figures(variant, strategy, device)),
                       rounds=1, iterations=1)
    figures = got
    figure_book.put(("reclaim", variant, strategy, device), figures)
    record(benchmark, scenario=SCENARIO.format(variant), strategy=strategy, device=device,
           figures=figures)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_unsafe_reclaim_crashes_on_the_chunked_input(figure_book, device):
    """verl 0.8.0's reclaim on the chunked MTP input is crash 2 itself; on CPU it is a SIGSEGV."""
    got = book_figures(figure_book, "chunked-mtp", "unsafe", device)
    assert "crashed" in got, got
    if device == "cpu":
        assert got == {"crashed": "SIGSEGV"}


# --- the relations the strategies must keep -------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("variant", _reclaim.VARIANTS)
def test_every_reclaim_releases_the_leak(figure_book, variant, device):
    """The reason a reclaim exists: with the #3221 leak, memory after backward is lower than
    without a reclaim -- for every strategy that runs on this input."""
    none = book_figures(figure_book, variant, "none", device)
    for strategy in ("unsafe", "mtp-skip", "ours"):
        if (variant, strategy) in _reclaim.CRASHES:
            continue
        got = book_figures(figure_book, variant, strategy, device)
        assert _net(got, "end_of_backward_bytes") < none["end_of_backward_bytes"], strategy
        assert _net(got, "peak_bytes") <= none["peak_bytes"], strategy
        assert _net(got, "after_forward_bytes") == none["after_forward_bytes"], strategy


def _net(figures: dict, key: str) -> int:
    """A figure less the bytes the reclaim keeps for itself all along (``reclaim_own_bytes``:
    the elements its released copies point at, a constant the CUDA figures count; 0 on CPU),
    so each relation compares what the step leaves."""
    return figures[key] - figures.get("reclaim_own_bytes", 0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_ours_matches_unsafe_after_backward_without_aliasing(figure_book, device):
    """No shared storage: the reclaim ends the backward with exactly what verl's reclaim leaves
    (less the elements its released copies point at, made once; verl's MTP skip, with no MTP
    layer, is verl's reclaim)."""
    unsafe = book_figures(figure_book, "plain", "unsafe", device)
    ours = book_figures(figure_book, "plain", "ours", device)
    skip = book_figures(figure_book, "plain", "mtp-skip", device)
    assert _net(ours, "end_of_backward_bytes") == unsafe["end_of_backward_bytes"]
    assert skip == unsafe


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_ours_matches_unsafe_peak_without_aliasing(figure_book, device):
    """And no higher a peak: the gradient megatron's backward returns is not kept on a tensor
    the leak holds once the backward has returned (verl clones the grad and frees the leaked one).
    ``<=`` because verl's clone is an extra allocation the allocator may count at the peak."""
    unsafe = book_figures(figure_book, "plain", "unsafe", device)
    ours = book_figures(figure_book, "plain", "ours", device)
    assert _net(ours, "peak_bytes") <= unsafe["peak_bytes"]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_ours_ends_below_mtp_skip_with_chunked_input(figure_book, device):
    """Chunked MTP input: verl's skip gives up the MTP checkpoint's memory (its leaked input
    holds the whole two-stream storage); ours lets the leaked copy go, so the storage goes after
    its last reader."""
    skip = book_figures(figure_book, "chunked-mtp", "mtp-skip", device)
    ours = book_figures(figure_book, "chunked-mtp", "ours", device)
    assert _net(ours, "end_of_backward_bytes") < skip["end_of_backward_bytes"]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_ours_peaks_no_higher_than_mtp_skip_with_chunked_input(figure_book, device):
    """Safety costs no peak memory over verl's skip: nothing is freed early, only let go."""
    skip = book_figures(figure_book, "chunked-mtp", "mtp-skip", device)
    ours = book_figures(figure_book, "chunked-mtp", "ours", device)
    assert _net(ours, "peak_bytes") <= skip["peak_bytes"]


@pytest.mark.cpu
def test_a_crash_is_named_through_a_ranks_prefix():
    """torch.distributed prefixes a rank's traceback lines (``[rank0]: ...``): the unsafe cell on
    the H200 ended in ``[rank0]: RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR`` and
    was reported as a failure to measure, not as the crash it is."""
    stderr = ("[rank0]: Traceback (most recent call last):\n"
              "[rank0]:   File \"x.py\", line 1, in <module>\n"
              "[rank0]: RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling ...\n"
              "[rank0]:[W1203 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group() ...\n")
    assert _reclaim._crash_name(stderr) == "RuntimeError"
    assert _reclaim._crash_name("torch.AcceleratorError: CUDA error: an illegal memory access") \
        == "AcceleratorError"
    assert _reclaim._crash_name("all went well\n") is None
