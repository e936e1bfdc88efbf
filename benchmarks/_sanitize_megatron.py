"""``recompute_sanitizer()`` on real megatron-core models (``benchmarks.megatron_scale``'s MoE
GPT -- optionally with megatron's aux loss and z-loss on -- and GPT+MTP; full recompute, or
selective recompute of the MoE layer and core attention; world size 1): no false positive,
and its step-time cost.

One child interpreter per (model, device): build, the model's first two steps under the
sanitizer (the detect tier; the locator would run in the second only after a detection in the
first), then steps without it, whose gradients must equal the first's (bitwise on CPU; on CUDA
within what two unsanitized steps differ by), then ``steps`` pairs of adjacent steps per mode
(``paired_step_times``): the sanitizer entered with no region watched (``_entered_no_region``)
against an unsanitized step (each arm's timed step after an untimed one), and each values mode
(all, sampled, metadata-only), entered once and left on as a training run enters it
(``values="sampled"`` / ``"none"`` keep their walk of the modules from step to step,
``fixes.sanitize._reach.Walks``), against the same sanitizer switched off for the other step of
the pair (its wrappers still in place: what being entered costs is the ``entered`` control's). Adjacent steps, not interleaved rounds: on the
H200 a cell's unsanitized steps drift by a quarter with a lag-one autocorrelation of 0.5-0.8
(``benchmarks.step_noise``), which spread the round-by-round ratios 0.7-1.3, wider than the
costs measured. Prints ``SANITIZE-MEGATRON {json}``: regions, tensors compared, detections,
the fresh walks of the modules, the gradient distances, per mode the median step time and the
median of the pairs' ratios, each with every pair (``*_repeats``), and the step that entered
the mode (``*_first_step_s``: the entry and the first walk).

Each pair starts with the collector's young generations empty, what lived after the first
steps frozen out of it (``gc.freeze``): a collection of the imports' million objects is then
no pair's alone.

``--clock thread`` (CPU, one intra-op thread) times this thread's CPU time instead of the wall:
what other processes' load on a shared machine does not add. ``--profile PATH`` also writes,
per sanitized mode, the calls a step makes beyond an unsanitized step's and their own time,
and the host functions its steps spend their time in (cProfile): where the sanitizer's cost
goes.

    python -m benchmarks._sanitize_megatron --model moe --device cpu --size 128x128 --steps 3
    python -m benchmarks._sanitize_megatron --model moe --aux-loss 0.01 --recompute moe-layer
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable

# mode name -> recompute_sanitizer(values=...); "recompute-entered": entered, no region run
MODES = {"none": None, "recompute": "all", "recompute-sampled": "sampled",
         "recompute-metadata": "none", "recompute-entered": "entered"}


def switch_of(sanitizer) -> Callable[[bool], None]:
    """Benchmark-only: an entered ``recompute_sanitizer()``'s wrappers made to read a switch
    (its ``_on``), on; the switch's setter. Off, they pass every region straight to the
    checkpoint, as if the sanitizer were not entered."""
    on = [True]
    sanitizer._on = lambda: on[0]
    return lambda state: on.__setitem__(0, state)


@contextlib.contextmanager
def _entered_no_region():
    """``recompute_sanitizer()`` entered (every checkpoint entry wrapped) with its regions
    passed straight to the checkpoint: what being entered costs a step before any region is
    watched. Benchmark-only."""
    from fixes.sanitize import recompute_sanitizer

    with recompute_sanitizer() as sanitizer:
        switch_of(sanitizer)(False)
        yield sanitizer


def _mode(name: str):
    from fixes.sanitize import recompute_sanitizer

    if MODES[name] is None:
        return contextlib.nullcontext()
    if MODES[name] == "entered":
        return _entered_no_region()
    return recompute_sanitizer(values=MODES[name])


def _fresh_moe_metrics() -> None:
    """Megatron's MoE metrics tracker dropped before a build: it is process-global and sizes
    its per-layer tensors by the first model that records (megatron-core 0.19), so a deeper
    model built after it fails in the router's z-loss record (``IndexError: index 15 is out of
    bounds for dimension 0 with size 4``: ``sanitizer_host_time --layers 4,16``)."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # an older megatron-core: no such tracker
        return
    destroy_moe_metrics_tracker()


def cell_step(model: str, device: str, hidden: int, seq: int, dtype: str, *,
              aux_loss: float = 0.0, recompute: str = "full", layers: int = 4):
    """(the model, its step): one training step of the cell (``layers`` transformer layers)
    -- zeroed gradients, forward, backward, the device synchronised -- returning copies of
    the gradients."""
    import torch

    from benchmarks.megatron_scale import _build
    from repro.harness.megatron_world import setup_megatron

    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import install_megatron_cpu_moe_shim

        install_megatron_cpu_moe_shim()
    _fresh_moe_metrics()
    gpt = _build(model, "allgather", hidden, seq, dtype, device, aux_loss_coeff=aux_loss,
                 recompute=recompute, layers=layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (1, seq), generator=g).to(device)
    labels = torch.randint(0, 32000, (1, seq), generator=g).to(device)
    pos = torch.arange(seq, device=device).unsqueeze(0)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).tril().logical_not()

    def step():
        gpt.zero_grad(set_to_none=True)
        gpt(ids, pos, mask, labels=labels).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return [p.grad.detach().clone() for p in gpt.parameters() if p.grad is not None]

    return gpt, step


def measure(model: str, device: str, hidden: int, seq: int, dtype: str, steps: int, *,
            aux_loss: float = 0.0, recompute: str = "full", clock: str = "wall",
            profile: str | None = None) -> dict:
    _, step = cell_step(model, device, hidden, seq, dtype, aux_loss=aux_loss,
                        recompute=recompute)
    now = time.thread_time if clock == "thread" else time.perf_counter

    def distance(a, b):
        return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))

    # The model's first steps run sanitized: its forward allocates megatron's scratch buffers
    # (GlobalMemoryBuffer), which its recompute then reuses (a false positive before allocations
    # were left out of the comparison); a second step is where the locator would name what the
    # detect tier found in the first.
    with _mode("recompute") as sanitizer:
        sanitized = step()
        step()
    reference = step()
    noise = distance(step(), reference)
    result = {"model": model, "device": device, "hidden": hidden, "seq": seq, "dtype": dtype,
              "aux_loss": aux_loss, "recompute": recompute, "clock": clock,
              "regions": sanitizer.regions, "recomputes": sanitizer.recomputes,
              "ops_compared": sanitizer.ops_compared,  # the locator's (0: nothing detected)
              "detections": sanitizer.detections, "located": sanitizer.located,
              "fingerprints": sanitizer.fingerprints,  # detect-tier prints, both sides
              "saved_compared": sanitizer.saved_compared,
              "outputs_compared": sanitizer.outputs_compared,
              "declared_ops": sanitizer.declared_ops, "module_walks": sanitizer.module_walks,
              "grad_noise": noise,
              "grad_distance": distance(sanitized, reference)}
    result.update(paired_step_times(step, now, steps))
    if profile:
        _profile(step, profile)
    return result


def _left_on(name: str, timed, pair, rounds: int) -> tuple[float, list[float], list[float]]:
    """Mode ``name`` entered once: (the step that entered it and made the first walk, then
    ``rounds`` pairs' steps on, and off)."""
    on, off = [], []
    with _mode(name) as sanitizer:
        switch = switch_of(sanitizer)

        def switched(state: bool) -> float:
            switch(state)
            return timed()

        first = timed()
        for i in range(rounds):
            t_on, t_off = pair(i, lambda: switched(True), lambda: switched(False))
            on.append(t_on)
            off.append(t_off)
    return first, on, off


def paired_step_times(step, now, rounds: int) -> dict:
    """Each mode's step time against the step next to it, ``rounds`` pairs each (the order
    swapped every round: a drift within a pair cancels over two): the ``entered`` control
    against an unsanitized step (each arm two steps, the second timed: neither timed step is
    the first after the pair's collection), and each values
    mode, entered once and left on -- as a training run enters it -- against the same
    sanitizer switched off for the other step of the pair (its wrappers passing the regions
    straight to the checkpoint: what ``entered`` measures). On the H200 the unsanitized steps
    of a cell drift by a quarter from step to step with a lag-one autocorrelation of 0.5-0.8
    (``benchmarks.step_noise``): a mode's steps compared with the control's a mode-round
    apart spread 0.7-1.3; adjacent steps share the drift.

    Per mode: ``<mode>_step_s`` (median), ``<mode>_step_time_ratio`` (the median of the
    pairs' ratios), each with every pair (``*_repeats``); a values mode's switched-off steps
    (``<mode>_off_step_s``), and the step that entered it and made the first walk
    (``<mode>_first_step_s``; no ratio: it has no step beside it)."""
    times: dict[str, list[float]] = {name: [] for name in MODES}
    ratios: dict[str, list[float]] = {name: [] for name in MODES}
    result: dict = {}

    def timed() -> float:
        t0 = now()
        step()
        return now() - t0

    def pair(i: int, first, second) -> tuple[float, float]:
        """(the first's time, the second's), run in this order on even rounds, swapped on odd
        ones; the young generations emptied before (off the clock)."""
        gc.collect()
        if i % 2:
            b = second()
            return first(), b
        a = first()
        return a, second()

    def plain() -> float:
        step()  # off the clock, as the entered arm's: neither timed step follows the collection
        return timed()

    def entered() -> float:
        with _entered_no_region():
            step()  # the entry's first step, off the clock: the entered control is left on
            return timed()

    # What lived after the first steps (modules, the model, its state) is frozen out of the
    # collector -- a long run's steady state; Megatron-LM's --manual-gc exists for collection
    # jitter. A collection the step's own allocations trigger is still inside its time.
    gc.collect()
    gc.freeze()
    try:
        for i in range(rounds):
            unsanitized, control = pair(i, plain, entered)
            times["none"].append(unsanitized)
            ratios["none"].append(1.0)
            times["recompute-entered"].append(control)
            ratios["recompute-entered"].append(control / unsanitized)
        for name in MODES:
            if MODES[name] in (None, "entered"):
                continue
            first, on, off = _left_on(name, timed, pair, rounds)
            times[name] += on
            ratios[name] += [a / b for a, b in zip(on, off, strict=True)]
            result[f"{name}_first_step_s"] = first
            result[f"{name}_off_step_s"] = statistics.median(off)
            result[f"{name}_off_step_s_repeats"] = off
    finally:
        gc.unfreeze()
    for name in MODES:
        result[f"{name}_step_s"] = statistics.median(times[name])
        result[f"{name}_step_s_repeats"] = times[name]
        result[f"{name}_step_time_ratio"] = statistics.median(ratios[name])
        result[f"{name}_step_time_ratio_repeats"] = ratios[name]
    return result


PROFILED_STEPS = 5  # per mode, after the step that enters it


def _profiled(step, name: str) -> pstats.Stats:
    profiler = cProfile.Profile()
    with _mode(name):
        step()
        profiler.enable()
        for _ in range(PROFILED_STEPS):
            step()
        profiler.disable()
    return pstats.Stats(profiler)


def _extra(sanitized: pstats.Stats, plain: pstats.Stats) -> list[tuple[float, float, tuple]]:
    """Per function ``sanitized`` calls more often than ``plain``: (extra calls, extra own
    seconds) a step, and the function's key -- the sanitizer's, and torch's that it calls."""
    rows = []
    for key, (_, n, tt, _, _) in sanitized.stats.items():
        _, n0, tt0, _, _ = plain.stats.get(key, (0, 0, 0.0, 0.0, None))
        if n > n0:
            rows.append(((n - n0) / PROFILED_STEPS, (tt - tt0) / PROFILED_STEPS, key))
    return rows


def induced(sanitized: pstats.Stats, plain: pstats.Stats) -> tuple[float, float]:
    """(calls, own seconds) a step of ``sanitized`` makes beyond ``plain``'s (``_extra``
    summed)."""
    rows = _extra(sanitized, plain)
    return sum(r[0] for r in rows), sum(r[1] for r in rows)


def induced_by_function(sanitized: pstats.Stats, plain: pstats.Stats, top: int = 40) -> str:
    """The ``top`` functions of ``_extra``, most extra calls first."""
    rows = sorted(_extra(sanitized, plain), key=lambda r: -r[0])
    return "".join(f"{calls:9.0f} {seconds * 1e6:9.0f} us  {file}:{line}({name})\n"
                   for calls, seconds, (file, line, name) in rows[:top])


def _profile(step, path: str) -> None:
    """``PROFILED_STEPS`` steps per mode under cProfile (after the step that enters it, as the
    timed ones): per sanitized mode, what it adds to an unsanitized step (calls, and their own
    time), the host functions by own time, and the sanitizer's by cumulative time."""
    out = io.StringIO()
    plain = _profiled(step, "none")
    for name in MODES:
        if MODES[name] in (None, "entered"):
            continue
        stats = _profiled(step, name)
        stats.stream = out
        calls, seconds = induced(stats, plain)
        out.write(f"== {name} (values={MODES[name]!r}): {calls:.0f} calls a step beyond the "
                  f"unsanitized step's, their own time {seconds * 1e3:.2f} ms a step (under "
                  f"cProfile)\n")
        out.write(f"== {name}: the functions it calls more often a step (extra calls, extra "
                  "own time)\n" + induced_by_function(stats, plain))
        stats.sort_stats("tottime").print_stats(30)
        out.write(f"== {name}: fixes/sanitize by cumulative time\n")
        stats.sort_stats("cumulative").print_stats("fixes/sanitize", 25)
    with open(path, "w") as f:
        f.write(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks._sanitize_megatron",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("moe", "gpt-mtp"), help="the model of one cell")
    p.add_argument("--cell", action="append", default=[], metavar="MODEL:SIZE:DTYPE:AUX:RECOMPUTE",
                   help="measure this cell (repeatable; instead of --model, --size, --dtype, "
                   "--aux-loss, --recompute): one interpreter for many cells, one line each")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where it runs")
    p.add_argument("--size", default="128x128", help="HIDDENxSEQ")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's dtype")
    p.add_argument("--steps", type=int, default=3,
                   help="pairs of adjacent steps per mode (paired_step_times)")
    p.add_argument("--aux-loss", type=float, default=0.0, metavar="COEFF",
                   help="MoE: megatron's aux-loss coefficient (z-loss: a tenth of it); 0: off")
    p.add_argument("--recompute", choices=("full", "moe-layer"), default="full",
                   help="full: one layer per checkpoint; moe-layer: the MoE layer and core "
                   "attention (selective)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: this thread's CPU time (CPU only)")
    p.add_argument("--profile", metavar="PATH", help="write per-mode cProfile tables here")
    args = p.parse_args(argv)
    if args.clock == "thread" and args.device != "cpu":
        p.error("--clock thread measures the host thread: CPU device only")
    if bool(args.cell) == bool(args.model):
        p.error("give exactly one of --model (one cell) or --cell (repeatable)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available here")
    if args.steps < 1:
        p.error(f"--steps must be >= 1 (pairs of steps per mode), got {args.steps}")
    if not args.cell and not _size_ok(args.size):
        p.error(f"--size {args.size!r}: expected HIDDENxSEQ, e.g. 1024x2048")
    cells = [cell_arg(c, p) for c in args.cell] or [
        (args.model, args.size, args.dtype, args.aux_loss, args.recompute)]
    for model, size, dtype, aux, recompute in cells:
        hidden, seq = (int(v) for v in size.split("x"))
        cell = {"model": model, "size": size, "dtype": dtype, "aux_loss": aux,
                "recompute": recompute}
        try:
            result = measure(model, args.device, hidden, seq, dtype, args.steps, aux_loss=aux,
                             recompute=recompute, clock=args.clock, profile=args.profile)
        except Exception as e:  # noqa: BLE001 -- reported per cell, the others still run
            result = {**cell, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
        print("SANITIZE-MEGATRON " + json.dumps(result), flush=True)
        gc.collect()  # this cell's model goes before the next is built
        if args.device == "cuda":
            import torch

            torch.cuda.empty_cache()
    return 0


def cell_arg(text: str, parser: argparse.ArgumentParser | None = None) -> tuple:
    """``MODEL:SIZE:DTYPE:AUX:RECOMPUTE`` -> (model, size, dtype, aux, recompute)."""
    parts = text.split(":")
    if (len(parts) != 5 or parts[0] not in ("moe", "gpt-mtp") or parts[2] not in ("fp32", "bf16")
            or parts[4] not in ("full", "moe-layer") or not _size_ok(parts[1])
            or not _float_ok(parts[3])):
        message = (f"--cell {text!r}: expected MODEL:SIZE:DTYPE:AUX:RECOMPUTE with MODEL in "
                   "moe, gpt-mtp, SIZE as HIDDENxSEQ (e.g. 1024x2048), DTYPE in fp32, bf16, AUX "
                   "a number (0: off) and RECOMPUTE in full, moe-layer")
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    return parts[0], parts[1], parts[2], float(parts[3]), parts[4]


def _size_ok(text: str) -> bool:
    hidden, _, seq = text.partition("x")
    return hidden.isdigit() and seq.isdigit() and int(hidden) > 0 and int(seq) > 0


def _float_ok(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
