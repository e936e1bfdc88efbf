"""The price of ``fixes.sanitize``: step time (forward + backward, full AC with the
mesh-preserving context_fn, inside the spmd mesh) of the plain transformer without a sanitizer,
under each one, and under all; under ``storage_sanitizer()`` once a released storage is
alive (every op then has its tensor arguments checked: the slow path); and under
``recompute_sanitizer()`` in full (op, metadata and value fingerprints of every op), sampled
(``values="sampled"``: fingerprints of every 8th op and the last) and metadata-only
(``values="none"``). The recompute sanitizer also runs on real megatron-core models (MoE GPT,
GPT+MTP; ``benchmarks._sanitize_megatron``, one child each): no false positive, and its cost,
measured there by adjacent steps (each values mode left on against itself switched off, and
the sanitizer entered with no region watched against no sanitizer).

The strategies run interleaved round by round (``benchmarks._spread``: clock and load drift hit
all alike). Figures: ``step_time_s``, the median of the rounds, and
``sanitizer_step_time_ratio``, the median of the round-by-round ratios strategy / no sanitizer
(above 1 means the sanitizer costs time), each with every round under ``*_repeats``: on a
shared machine a ratio means something only with that spread (the dashboard shows it so).
Times are not gated (only ``*_bytes`` are); the test below the benchmark asserts what must hold
whatever the timing: the sanitizers change no gradient.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import statistics
import time

import pytest
import torch

from benchmarks import _ac, _spread
from benchmarks._bench import DEVICE_PARAMS, record
from repro import run_isolated

# These benchmarks enter the sanitizers themselves (they refuse to be nested).
pytestmark = pytest.mark.no_stackfix_sanitize
SCENARIO = "sanitizers/plain-transformer-full-ac"
STRATEGIES = ("none", "storage", "mesh", "storage+mesh", "storage-slow-path", "recompute",
              "recompute-sampled", "recompute-metadata", "storage+mesh+recompute")
# recompute_sanitizer(values=...) per strategy name
RECOMPUTE_VALUES = {"recompute-sampled": "sampled", "recompute-metadata": "none"}
ROUNDS = {"cpu": 15, "cuda": 12}  # the H200 refresh fits one device call


@contextlib.contextmanager
def _sanitized(strategy: str):
    from fixes.sanitize import mesh_sanitizer, recompute_sanitizer, storage_sanitizer

    with contextlib.ExitStack() as stack:
        if "storage" in strategy:
            stack.enter_context(storage_sanitizer())
        if "mesh" in strategy:
            stack.enter_context(mesh_sanitizer())
        if "recompute" in strategy:
            stack.enter_context(recompute_sanitizer(values=RECOMPUTE_VALUES.get(strategy, "all")))
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
    """Each strategy's step time per round, the strategies interleaved (benchmarks._spread)."""
    step = _step(setup, device)
    for s in STRATEGIES:  # warm-up each
        with _sanitized(s):
            step()

    def run_one(strategy: str) -> float:
        with _sanitized(strategy):
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

    return _spread.interleaved(STRATEGIES, run_one, ROUNDS[device])


def sanitizer_figures(times: dict[str, list[float]], strategy: str) -> dict:
    """``strategy``'s step time and its ratio to no sanitizer, round by round: the medians, and
    every round (``*_repeats``) for the spread."""
    ratios = _spread.ratios_to(times, "none")[strategy]
    return {"step_time_s": statistics.median(times[strategy]),
            "step_time_s_repeats": list(times[strategy]),
            "sanitizer_step_time_ratio": statistics.median(ratios),
            "sanitizer_step_time_ratio_repeats": ratios}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sanitizer_step_time(benchmark, figure_book, device, strategy):
    times: dict = {}
    # pytest-benchmark's time is the interleaved rounds' (the first test of the session pays
    # them); the figures are the rounds' own times. No warm-up of each strategy here: the
    # rounds warm up every strategy first (a pytest-benchmark warm-up per test was 12 more
    # steps, and a model built, for each of the nine strategies on CUDA).
    benchmark.pedantic(lambda: times.update(figure_book.get(
        ("sanitizers", device), lambda: interleaved_step_times(_setup(device), device))),
        rounds=1, iterations=1)
    record(benchmark, scenario=SCENARIO, strategy=strategy, device=device,
           figures=sanitizer_figures(times, strategy))


@pytest.mark.cpu
def test_the_figures_are_medians_of_interleaved_rounds_with_every_round_recorded():
    """The ratio is taken round by round (a drift of the machine's load over the run cancels
    out), and each round's time and ratio is recorded for the dashboard's spread."""
    times = {"none": [1.0, 2.0, 1.0, 4.0, 1.0], "storage": [1.1, 2.4, 1.0, 4.2, 3.0]}
    figures = sanitizer_figures(times, "storage")
    assert figures["step_time_s_repeats"] == times["storage"]
    assert figures["sanitizer_step_time_ratio_repeats"] == pytest.approx([1.1, 1.2, 1.0, 1.05, 3.0])
    assert figures["sanitizer_step_time_ratio"] == pytest.approx(1.1)  # not median / median (2.2)
    assert figures["step_time_s"] == 2.4
    assert not any("_min_" in k for k in figures)


@pytest.mark.cpu
def test_megatron_cells_pair_adjacent_steps_so_a_drift_cancels(monkeypatch):
    """``paired_step_times`` on a virtual clock whose steps slow by 5% each, whose first step
    after a collection costs 5% more, and whose steps cost 1.25x while a region is recorded:
    every values mode reads its 1.25 and the entered control its 1.0, each within 0.5% (a
    pair run in one order only reads the drift, ~2% off; an arm whose timed step is the first
    after the collection reads that cost). Every pair is recorded, the swapped ones on the
    other side of 1.25."""
    from benchmarks import _sanitize_megatron as sm

    live, clock, count, collected = [], [0.0], [0], [False]
    real_mode, real_collect = sm._mode, sm.gc.collect

    @contextlib.contextmanager
    def capturing(name):
        with real_mode(name) as sanitizer:
            live.append(sanitizer)
            yield sanitizer

    def collect(*args):
        collected[0] = True
        return real_collect(*args)

    monkeypatch.setattr(sm, "_mode", capturing)
    monkeypatch.setattr(sm.gc, "collect", collect)
    x = torch.ones(3, requires_grad=True)

    def step():
        before = sum(s.regions for s in live)
        torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
        count[0] += 1
        cost = (1 + 0.05 * count[0]) * (1.05 if collected[0] else 1.0)
        collected[0] = False
        clock[0] += cost * (1.25 if sum(s.regions for s in live) > before else 1.0)

    got = sm.paired_step_times(step, lambda: clock[0], rounds=6)
    for mode in ("recompute", "recompute-sampled", "recompute-metadata"):
        assert got[f"{mode}_step_time_ratio"] == pytest.approx(1.25, rel=0.005), mode
        repeats = got[f"{mode}_step_time_ratio_repeats"]
        assert len(repeats) == 6
        # the order swapped every pair: consecutive pairs on either side of 1.25
        assert all((a - 1.25) * (b - 1.25) < 0 for a, b in zip(repeats[:-1], repeats[1:], strict=True))
        assert got[f"{mode}_off_step_s"] < got[f"{mode}_step_s"]
        assert f"{mode}_first_step_s" in got
    assert got["recompute-entered_step_time_ratio"] == pytest.approx(1.0, rel=0.005)
    assert got["none_step_time_ratio_repeats"] == [1.0] * 6
    # unpaired, the last mode against the first block's unsanitized steps reads the drift
    assert got["recompute-metadata_step_s"] / got["none_step_s"] > 1.5


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


# Real megatron-core models under recompute_sanitizer(): (model, size, dtype, steps, aux-loss
# coefficient, recompute) per device. The MoE GPT runs with megatron's aux loss off and on (on:
# the router's aux-loss ops run in the recompute only, issue 34's false positive), under full
# recompute and under selective recompute of the MoE layer and core attention.
# CPU: small and single-threaded (on a shared 2-core machine two intra-op threads per process
# turned every extra kernel into a thread wake-up and the ratio into a measure of the load).
# ``steps``: pairs of adjacent steps per mode (benchmarks._sanitize_megatron.paired_step_times);
# on the H200 40 pairs put a median's 90% bootstrap interval within +-2% (benchmarks.step_noise);
# 24 fit the refresh's call.
MEGATRON_CELLS = {
    "cpu": [("moe", "128x128", "fp32", 10, 0.0, "full"),
            ("moe", "128x128", "fp32", 10, 0.01, "full"),
            ("moe", "128x128", "fp32", 10, 0.01, "moe-layer"),
            ("gpt-mtp", "128x128", "fp32", 10, 0.0, "full")],
    "cuda": [(m, "1024x2048", d, 24, 0.0, "full") for m in ("moe", "gpt-mtp")
             for d in ("fp32", "bf16")]
    + [("moe", "1024x2048", d, 24, 0.01, r) for d in ("fp32", "bf16")
       for r in ("full", "moe-layer")],
}


def _cell_id(device, model, size, dtype, steps, aux, recompute) -> str:
    extra = (f"-aux{aux:g}" if aux else "") + ("" if recompute == "full" else f"-{recompute}")
    return f"{model}-{size}-{dtype}{extra}-{device}"


MEGATRON_PARAMS = [
    pytest.param(device, *cell, marks=mark, id=_cell_id(device, *cell))
    for device, mark in (("cpu", pytest.mark.cpu), ("cuda", pytest.mark.gpu))
    for cell in MEGATRON_CELLS[device]
]
_NO_MEGATRON = importlib.util.find_spec("megatron") is None


def _megatron_cells_in_child(device: str) -> dict[str, dict]:
    """Every megatron cell of ``device`` in one child (one interpreter and CUDA context for
    all: a child per cell spent more time starting than measuring), by cell id."""
    cells = MEGATRON_CELLS[device]
    steps = {c[3] for c in cells}
    assert len(steps) == 1, "one child: one step count per device"
    args = ["--device", device, "--steps", str(steps.pop())]
    for model, size, dtype, _, aux, recompute in cells:
        args += ["--cell", f"{model}:{size}:{dtype}:{aux:g}:{recompute}"]
    if device == "cpu":  # one intra-op thread: its CPU time, what neighbours' load does not add
        args += ["--clock", "thread"]
    r = run_isolated(module="benchmarks._sanitize_megatron", args=args, timeout=1800,
                     env={"OMP_NUM_THREADS": "1"} if device == "cpu" else None,
                     forkserver=True)  # torch (and megatron-core) imported once
    found = [json.loads(ln.split(" ", 1)[1]) for ln in r.stdout.splitlines()
             if ln.startswith("SANITIZE-MEGATRON ")]
    # a child that died takes the cells it did not reach with it (each test then says so,
    # without starting the child again)
    died = {"error": f"the child exited {r.returncode}: {r.stderr[-4000:]}"}
    found += [died] * (len(cells) - len(found))
    return {_cell_id(device, *cell): got for cell, got in zip(cells, found, strict=True)}


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("device,model,size,dtype,steps,aux,recompute", MEGATRON_PARAMS)
def test_recompute_sanitizer_on_megatron(benchmark, figure_book, device, model, size, dtype,
                                         steps, aux, recompute):
    """No false positive on a real MoE GPT (aux loss off and on) / GPT+MTP with full or MoE-layer
    recompute (gradients equal to an unsanitized step's, bitwise on CPU), and the step-time
    ratios of every mode."""
    found: dict = {}

    def run_child():
        cells = figure_book.get(("recompute-sanitizer", device),
                                lambda: _megatron_cells_in_child(device))
        found.update(cells[_cell_id(device, model, size, dtype, steps, aux, recompute)])
        assert "error" not in found, found["error"]

    benchmark.pedantic(run_child, rounds=1, iterations=1)
    assert found["regions"] >= 4 and found["recomputes"] == found["regions"]
    # the detect tier compared what backward uses and found nothing (the locator never ran)
    assert found["saved_compared"] + found["outputs_compared"] > 0
    assert found["detections"] == found["located"] == 0
    if device == "cpu":
        assert found["grad_noise"] == 0.0 and found["grad_distance"] == 0.0
    else:
        assert found["grad_distance"] <= found["grad_noise"] * 4 + 1e-12
    figures = {k: v for k, v in found.items()
               if k.endswith(("_step_s", "_step_time_ratio", "_repeats"))}
    assert len(found["recompute_step_time_ratio_repeats"]) == steps
    figures.update(compared=found["saved_compared"] + found["outputs_compared"],
                   regions=found["regions"])
    extra = (f"-aux{aux:g}" if aux else "") + ("" if recompute == "full" else f"-{recompute}")
    record(benchmark, scenario=f"recompute-sanitizer/megatron-{model}-{size}-{dtype}{extra}",
           strategy="recompute", device=device, figures=figures)


@pytest.mark.cpu
def test_the_launch_sweep_is_cuda_only_and_holds_the_shipped_shape(capsys):
    """``--sweep`` times Triton launch shapes: on CPU a usage error naming CUDA; the shipped
    shape is among those it times (its row is what the others are compared with)."""
    from benchmarks import fused_print
    from fixes.sanitize import _fused

    with pytest.raises(SystemExit) as exit_info:
        fused_print.main(["--device", "cpu", "--sweep"])
    assert exit_info.value.code == 2
    assert "CUDA only" in capsys.readouterr().err
    assert (_fused.CHUNK, _fused.BLOCK, _fused.NUM_WARPS) in fused_print.SWEEP


@pytest.mark.cpu
@pytest.mark.parametrize("argv,message", [
    (["--cell", "moe:1024:fp32:0:full"], "SIZE as HIDDENxSEQ"),
    (["--cell", "moe:128x8:fp32:off:full"], "AUX a number"),
    (["--model", "moe", "--steps", "0"], "--steps must be >= 1"),
    (["--model", "moe", "--size", "big"], "expected HIDDENxSEQ"),
])
def test_the_megatron_cells_runner_names_what_a_bad_argument_should_be(capsys, argv, message):
    from benchmarks import _sanitize_megatron as sm

    with pytest.raises(SystemExit) as exit_info:
        sm.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
