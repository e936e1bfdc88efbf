"""GPU only: the price of ``single_threaded_backward()`` (fixes.torchtitan) -- step time and
bytes of a full-AC step with autograd's device threads (torch's default on CUDA) and with
backward kept on the calling thread. On CPU tensors backward always runs on the calling thread,
so there is nothing to compare there.

The ratio is measured with the two variants interleaved round by round (so clock and thermal
drift hit both alike) and reported as median(single) / median(multi): above 1 means the single
thread costs time.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from benchmarks import _ac
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
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for _ in range(2):  # warm-up both
        for s in STRATEGIES:
            steps[s](setup.forward())
    torch.cuda.synchronize()
    for _ in range(rounds):
        for s in STRATEGIES:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps[s](setup.forward())
            torch.cuda.synchronize()
            times[s].append(time.perf_counter() - t0)
    medians = {s: statistics.median(v) for s, v in times.items()}
    return {
        "step_time_multithreaded_s": medians["multithreaded"],
        "step_time_single_threaded_s": medians["single-threaded"],
        "step_time_ratio": medians["single-threaded"] / medians["multithreaded"],
    }


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
