"""``recompute_sanitizer()`` on real megatron-core models (``benchmarks.megatron_scale``'s MoE
GPT -- optionally with megatron's aux loss and z-loss on -- and GPT+MTP; full recompute, or
selective recompute of the MoE layer and core attention; world size 1): no false positive,
and its step-time cost.

One child interpreter per (model, device): build, the model's first two steps under the
sanitizer (the detect tier; the locator would run in the second only after a detection in the
first), then steps without it, whose gradients must equal the first's (bitwise on CPU; on CUDA
within what two unsanitized steps differ by), then ``steps`` rounds of each mode, interleaved
(none, all, sampled, metadata-only, and the sanitizer entered with no region watched,
``_entered_no_region``; ``benchmarks._spread``). A round enters the mode and runs
``TIMED_STEPS + 1`` steps: the mean of the last ``TIMED_STEPS`` is its time -- steps of a
sanitizer left on, as a training run enters it once (``values="sampled"`` / ``"none"`` keep
their walk of the modules from step to step, ``fixes.sanitize._reach.Walks``) -- and the
first, which pays the entry and the first walk, is recorded beside it (``*_first_step_*``).
Prints ``SANITIZE-MEGATRON {json}``: regions, tensors compared, detections, the fresh walks of
the modules, the gradient distances, per mode the median step time and the median of the
round-by-round ratios, each with every round (``*_repeats``).

Each round starts with the collector's young generations empty, what lived after the first
steps frozen out of it (``gc.freeze``): a collection of the imports' million objects is then
no round's alone. (Whether that was the spread of the unsanitized control, 0.85-1.05 at
7388bb7 on the H200, is not shown: the next H200 runs came after the refresh's memory
sessions, on a slower host.)

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

from benchmarks._spread import interleaved, ratios_to

# mode name -> recompute_sanitizer(values=...); "recompute-entered": entered, no region run
MODES = {"none": None, "recompute": "all", "recompute-sampled": "sampled",
         "recompute-metadata": "none", "recompute-entered": "entered"}


@contextlib.contextmanager
def _entered_no_region():
    """``recompute_sanitizer()`` entered (every checkpoint entry wrapped) with its regions
    passed straight to the checkpoint: what being entered costs a step before any region is
    watched. Benchmark-only."""
    from fixes.sanitize import recompute_sanitizer

    with recompute_sanitizer() as sanitizer:
        sanitizer._on = lambda: False  # the wrappers call the checkpoint as if not entered
        yield sanitizer


def _mode(name: str):
    from fixes.sanitize import recompute_sanitizer

    if MODES[name] is None:
        return contextlib.nullcontext()
    if MODES[name] == "entered":
        return _entered_no_region()
    return recompute_sanitizer(values=MODES[name])


def cell_step(model: str, device: str, hidden: int, seq: int, dtype: str, *,
              aux_loss: float = 0.0, recompute: str = "full"):
    """(the model, its step): one training step of the cell -- zeroed gradients, forward,
    backward, the device synchronised -- returning copies of the gradients."""
    import torch

    from benchmarks.megatron_scale import _build
    from repro.harness.megatron_world import setup_megatron

    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import install_megatron_cpu_moe_shim

        install_megatron_cpu_moe_shim()
    gpt = _build(model, "allgather", hidden, seq, dtype, device, aux_loss_coeff=aux_loss,
                 recompute=recompute)
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
    first: dict[str, list[float]] = {name: [] for name in MODES}

    def timed_step(name: str) -> float:
        """The mode entered for ``TIMED_STEPS + 1`` steps: the mean time of the last
        ``TIMED_STEPS``; the first's kept in ``first``."""
        gc.collect()  # the young generations empty: every round's collections alike
        with _mode(name):
            t0 = now()
            step()
            t1 = now()
            for _ in range(TIMED_STEPS):
                step()
            t2 = now()
        first[name].append(t1 - t0)
        return (t2 - t1) / TIMED_STEPS

    # Rounds alike for the collector (steps of 30-80 ms; an unsanitized control read 0.85-1.05
    # at 7388bb7): what lived after the first steps (modules, the model, its state) is frozen
    # out of it -- a long run's steady state; Megatron-LM's --manual-gc exists for collection
    # jitter -- and each round starts with the young generations empty. A collection the
    # step's own allocations trigger is still inside its time.
    gc.collect()
    gc.freeze()
    try:
        times = interleaved(list(MODES), timed_step, steps)
    finally:
        gc.unfreeze()
    for prefix, measured in (("", times), ("first_", first)):
        ratios = ratios_to(measured, "none")
        for name in MODES:
            result[f"{name}_{prefix}step_s"] = statistics.median(measured[name])
            result[f"{name}_{prefix}step_s_repeats"] = measured[name]
            result[f"{name}_{prefix}step_time_ratio"] = statistics.median(ratios[name])
            result[f"{name}_{prefix}step_time_ratio_repeats"] = ratios[name]
    if profile:
        _profile(step, profile)
    return result


# Steps timed per round, after the one that enters the mode: their mean is the round's time.
# One, measured: three (91b69ff) did not narrow the rounds' spread on the H200's host-bound
# cells (the no-op control 0.72-1.30 a round, as with one) and took the refresh ~65 s more
# (benchmarks/results/evidence/2026-12-04-h200-refresh3/). The spread is not step-to-step jitter.
TIMED_STEPS = 1
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
    p = argparse.ArgumentParser(prog="python -m benchmarks._sanitize_megatron")
    p.add_argument("--model", choices=("moe", "gpt-mtp"))
    p.add_argument("--cell", action="append", default=[], metavar="MODEL:SIZE:DTYPE:AUX:RECOMPUTE",
                   help="measure this cell (repeatable; instead of --model, --size, --dtype, "
                   "--aux-loss, --recompute): one interpreter for many cells, one line each")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", default="128x128", help="HIDDENxSEQ")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--aux-loss", type=float, default=0.0, metavar="COEFF",
                   help="MoE: megatron's aux-loss coefficient (z-loss: a tenth of it); 0: off")
    p.add_argument("--recompute", choices=("full", "moe-layer"), default="full")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
    p.add_argument("--profile", metavar="PATH", help="write per-mode cProfile tables here")
    args = p.parse_args(argv)
    if args.clock == "thread" and args.device != "cpu":
        p.error("--clock thread measures the host thread: CPU device only")
    if bool(args.cell) == bool(args.model):
        p.error("give --model or --cell, not both")
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
            or parts[4] not in ("full", "moe-layer")):
        message = (f"--cell {text!r}: expected MODEL:SIZE:DTYPE:AUX:RECOMPUTE with MODEL in "
                   "moe, gpt-mtp, DTYPE in fp32, bf16 and RECOMPUTE in full, moe-layer")
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    return parts[0], parts[1], parts[2], float(parts[3]), parts[4]


if __name__ == "__main__":
    raise SystemExit(main())
