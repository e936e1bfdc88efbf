"""GPU only: the price of ``single_threaded_backward()`` (fixes.torchtitan) -- step time and
bytes of a full-AC step with autograd's device threads (torch's default on CUDA) and with
backward kept on the calling thread. On CPU tensors backward always runs on the calling thread,
so there is nothing to compare there.

The ratio is measured with the two variants interleaved round by round (``benchmarks._spread``:
clock and thermal drift hit both alike) and reported as the median of the round-by-round ratios
single / multi, every round recorded for its spread: above 1 means the single thread costs
time.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from benchmarks import _ac, _spread
from benchmarks._bench import record, timed
from benchmarks._measure import measure_memory

SCENARIO = "backward-threads/plain-transformer-full-ac"
STRATEGIES = ("multithreaded", "single-threaded")
INTERLEAVED_ROUNDS = 20


def _backward(strategy: str, setup: _ac.ACSetup):
    from fixes.torchtitan import single_threaded_backward

    def backward(loss):
        if strategy == "single-threaded":
            with single_threaded_backward():
                setup.backward(loss)
        else:
            setup.backward(loss)

    return backward


def _setup() -> _ac.ACSetup:
    # Full AC with the mesh-preserving context_fn: the configuration that works either way, so
    # the comparison isolates the thread placement.
    return _ac.build("plain-transformer", _ac.ACCase("full", mesh_ctx=True), torch.device("cuda"))


def interleaved_step_times(setup: _ac.ACSetup, rounds: int = INTERLEAVED_ROUNDS) -> dict:
    steps = {s: _backward(s, setup) for s in STRATEGIES}
    for _ in range(2):  # warm-up both
        for s in STRATEGIES:
            steps[s](setup.forward())
    torch.cuda.synchronize()

    def run_one(strategy: str) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps[strategy](setup.forward())
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return thread_figures(_spread.interleaved(STRATEGIES, run_one, rounds))


def thread_figures(times: dict[str, list[float]]) -> dict:
    """Medians, and every round (``*_repeats``); the ratio is the median of the round-by-round
    ratios single / multi."""
    ratios = _spread.ratios_to(times, "multithreaded")["single-threaded"]
    return {
        "step_time_multithreaded_s": statistics.median(times["multithreaded"]),
        "step_time_multithreaded_s_repeats": times["multithreaded"],
        "step_time_single_threaded_s": statistics.median(times["single-threaded"]),
        "step_time_single_threaded_s_repeats": times["single-threaded"],
        "step_time_ratio": statistics.median(ratios),
        "step_time_ratio_repeats": ratios,
    }


@pytest.mark.cpu
def test_the_ratio_is_taken_round_by_round_with_every_round_recorded():
    figures = thread_figures({"multithreaded": [1.0, 2.0, 4.0], "single-threaded": [1.1, 2.0, 8.0]})
    assert figures["step_time_ratio_repeats"] == pytest.approx([1.1, 1.0, 2.0])
    assert figures["step_time_ratio"] == pytest.approx(1.1)
    assert figures["step_time_single_threaded_s_repeats"] == [1.1, 2.0, 8.0]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_threads_step(benchmark, figure_book, strategy):
    setup = _setup()
    backward = _backward(strategy, setup)
    timed(benchmark, "cuda")(lambda: backward(setup.forward()))
    figures = measure_memory(setup.forward, backward=backward, device="cuda").as_extra_info()
    ratio = figure_book.get(("backward-threads",), lambda: interleaved_step_times(setup))
    if strategy == "single-threaded":
        figures.update(ratio)
    record(benchmark, scenario=SCENARIO, strategy=strategy, device="cuda", figures=figures)


@pytest.mark.gpu
def test_single_threaded_backward_keeps_recompute_on_the_calling_thread():
    """The mechanism the step-time ratio pays for: with device threads the recompute runs on
    another thread; inside single_threaded_backward() on the caller's."""
    setup = _setup()
    blocks = [layer.block for layer in setup.model.layers]
    recompute_threads: dict[str, set[int]] = {}
    for strategy in STRATEGIES:
        loss = setup.forward()  # the forward's own block calls are not recompute: hook after it
        threads: set[int] = set()
        handles = [b.register_forward_pre_hook(lambda *_, seen=threads: seen.add(threading.get_ident()))
                   for b in blocks]
        try:
            _backward(strategy, setup)(loss)
            torch.cuda.synchronize()
        finally:
            for h in handles:
                h.remove()
        recompute_threads[strategy] = threads
    me = threading.get_ident()
    assert recompute_threads["single-threaded"] == {me}
    assert recompute_threads["multithreaded"] and me not in recompute_threads["multithreaded"]
