"""What every benchmark module shares: device parameters with their markers, the figure book
(figures measured once per session, read by the relation tests), and recording into
pytest-benchmark's ``extra_info``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from benchmarks._measure import device_kind

DEVICE_PARAMS = (
    pytest.param("cpu", marks=pytest.mark.cpu, id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
)
# pytest-benchmark timing: on CPU a single round (the figures that matter are bytes and FLOPs,
# and the CI budget is two cores for two minutes); on GPU enough rounds for a mean.
ROUNDS = {"cpu": 1, "cuda": 10}
WARMUP_ROUNDS = {"cpu": 0, "cuda": 2}


class FigureBook:
    """Figures by key, measured at most once per session: the benchmarks fill it, the tests of
    the relations between strategies read it (measuring what a -k selection left out)."""

    def __init__(self) -> None:
        self._figures: dict[tuple, dict] = {}

    def put(self, key: tuple, figures: dict) -> dict:
        self._figures[key] = figures
        return figures

    def get(self, key: tuple, measure: Callable[[], dict]) -> dict:
        if key not in self._figures:
            self._figures[key] = measure()
        return self._figures[key]


def timed(benchmark, device: str) -> Callable[[Callable[[], object]], None]:
    """Run a step under pytest-benchmark (the warm-up before the instrumented steps)."""

    def run(step: Callable[[], object]) -> None:
        if device == "cuda":
            def step_synced():
                step()
                torch.cuda.synchronize()
        else:
            step_synced = step
        benchmark.pedantic(step_synced, rounds=ROUNDS[device], iterations=1,
                           warmup_rounds=WARMUP_ROUNDS[device])

    return run


def untimed(step: Callable[[], object]) -> None:
    step()


def environment(device: str) -> dict[str, str]:
    """What a figure was measured on, as strings (the dashboard shows them and notes a change
    between runs): torch, megatron-core where it is installed, and the GPU's name on CUDA."""
    from importlib.metadata import PackageNotFoundError, version

    env = {"torch_version": torch.__version__}
    try:
        env["megatron_core_version"] = version("megatron-core")
    except PackageNotFoundError:
        pass
    if torch.device(device).type == "cuda":
        env["gpu_name"] = torch.cuda.get_device_name(torch.device(device))
    return env


def record(benchmark, *, scenario: str, strategy: str, device: str, figures: dict) -> None:
    """The benchmark's ``extra_info``: its identity, its environment and ``figures`` (numbers,
    or ``{"crashed": "SIGSEGV"}`` for a strategy that crashes)."""
    benchmark.extra_info.update(
        scenario=scenario, strategy=strategy, device_kind=device_kind(device),
        **environment(device), **figures,
    )
