"""The price of ``fixes.sanitize``: step time (forward + backward, full AC with the
mesh-preserving context_fn, inside the spmd mesh) of the plain transformer without a sanitizer,
under each one, and under both; and under ``storage_sanitizer()`` once a released storage is
alive (every op then has its tensor arguments checked: the slow path).

The strategies run interleaved round by round (clock and load drift hit all alike). Figures:
medians (``step_time_s``, ``sanitizer_step_time_ratio`` = strategy / no sanitizer; above 1 means
the sanitizer costs time) and minima (``step_time_min_s``, ``sanitizer_step_time_min_ratio``:
on a shared CPU machine the neighbours' load swamps medians, the fastest round of each strategy
is its cost without interference). Times are not gated (only ``*_bytes`` are); the test below
the benchmark asserts what must hold whatever the timing: the sanitizers change no gradient.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import pytest
import torch

from benchmarks import _ac
from benchmarks._bench import DEVICE_PARAMS, record, timed

SCENARIO = "sanitizers/plain-transformer-full-ac"
STRATEGIES = ("none", "storage", "mesh", "storage+mesh", "storage-slow-path")
ROUNDS = {"cpu": 15, "cuda": 20}


@contextlib.contextmanager
def _sanitized(strategy: str):
    from fixes.sanitize import mesh_sanitizer, storage_sanitizer

    with contextlib.ExitStack() as stack:
        if "storage" in strategy:
            stack.enter_context(storage_sanitizer())
        if "mesh" in strategy:
            stack.enter_context(mesh_sanitizer())
        if strategy == "storage-slow-path":
            # A released storage kept alive by a tensor: the check runs on every op.
            released = torch.empty(16)
            released.untyped_storage().resize_(0)
            stack.callback(lambda: released)
        yield


def _setup(device: str) -> _ac.ACSetup:
    return _ac.build("plain-transformer", _ac.ACCase("full", mesh_ctx=True), torch.device(device))


def _step(setup: _ac.ACSetup, device: str):
    def step():
        setup.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def interleaved_step_times(setup: _ac.ACSetup, device: str) -> dict[str, list[float]]:
    step = _step(setup, device)
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for s in STRATEGIES:  # warm-up each
        with _sanitized(s):
            step()
    for _ in range(ROUNDS[device]):
        for s in STRATEGIES:
            with _sanitized(s):
                t0 = time.perf_counter()
                step()
                times[s].append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sanitizer_step_time(benchmark, figure_book, device, strategy):
    setup = _setup(device)
    with _sanitized(strategy):
        timed(benchmark, device)(setup.step)
    times = figure_book.get(("sanitizers", device),
                            lambda: interleaved_step_times(_setup(device), device))
    median = {s: statistics.median(v) for s, v in times.items()}
    fastest = {s: min(v) for s, v in times.items()}
    figures = {"step_time_s": median[strategy],
               "sanitizer_step_time_ratio": median[strategy] / median["none"],
               "step_time_min_s": fastest[strategy],
               "sanitizer_step_time_min_ratio": fastest[strategy] / fastest["none"]}
    record(benchmark, scenario=SCENARIO, strategy=strategy, device=device, figures=figures)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_sanitizers_change_no_gradient(device):
    """Each sanitizer's grads differ from the unsanitized run's by no more than two unsanitized
    runs differ from each other (exactly 0 on CPU; CUDA backward kernels with atomics are not
    bitwise repeatable, which an H200 run showed as a torch.equal failure)."""

    def grads(strategy):
        setup = _setup(device)
        with _sanitized(strategy):
            setup.step()
        return [p.grad.clone() for p in setup.model.parameters()]

    def distance(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    reference = grads("none")
    noise = distance(grads("none"), reference)
    if device == "cpu":
        assert noise == 0.0
    for strategy in STRATEGIES[1:]:
        assert distance(grads(strategy), reference) <= noise * 4 + 1e-12, strategy
