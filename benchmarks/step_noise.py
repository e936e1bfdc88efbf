"""Where the spread of a megatron cell's step time comes from on this host.

The sanitizer's step-time ratios (``benchmarks._sanitize_megatron``) were medians of interleaved
rounds; on the H200 the unsanitized MoE step alone spread 63-98 ms from round to round, wider
than the costs being measured (what this probe found made them adjacent steps since). This probe times the unsanitized step of one cell under a few
variants, each step on its own, and records beside each step's wall time what could explain it:

- ``consecutive``: steps back to back, the collector frozen after warm-up (as the bench runs);
- ``rounds``: the bench's former pattern -- a full collection, one step, then the timed step;
- ``gc-off``: the collector disabled;
- ``pinned``: this thread (and what it starts) on one CPU;
- ``toggled``: ``recompute_sanitizer(values=...)`` entered once per values mode and switched
  on and off step by step (the order swapped every pair): the left-on cost paired with the same
  sanitizer switched off, its wrappers passing the regions straight through, one step apart
  (``toggled-<values>-on`` / ``toggled-<values>-off``, and the pairs' ratios).

``--kernels`` (CUDA): one toggled step on and one off under torch.profiler, the device time of
each kernel (what the sanitizer adds on the device, apart from the host).

Per step: wall time, this thread's CPU time, its involuntary and voluntary context switches,
the collector's time and collections inside the step, and (CUDA) the allocator's device
allocations. Per variant: median, 10th-90th percentile, the lag-1 autocorrelation of the wall
times (near 0: step-to-step noise, which more steps average out; near 1: drift, which
interleaving cancels). Writes JSON (``--json``) and prints one line per variant.

    python -m benchmarks.step_noise --device cuda --cell moe:1024x2048:bf16:0:full --steps 40
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import time

from benchmarks._spread import interleaved

VARIANTS = ("consecutive", "rounds", "gc-off", "pinned", "toggled")


class _GcClock:
    """Time spent in the collector, and its collections, while installed."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._start = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1


def _timed(step, device: str, gc_clock: _GcClock) -> dict:
    import torch

    def allocs():
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if device == "cuda" else 0

    a0, r0, g0, n0 = allocs(), resource.getrusage(resource.RUSAGE_THREAD), gc_clock.seconds, \
        gc_clock.collections
    w0, c0 = time.perf_counter(), time.thread_time()
    step()
    w1, c1 = time.perf_counter(), time.thread_time()
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    return {"wall_s": w1 - w0, "cpu_s": c1 - c0, "involuntary": r1.ru_nivcsw - r0.ru_nivcsw,
            "voluntary": r1.ru_nvcsw - r0.ru_nvcsw, "gc_s": gc_clock.seconds - g0,
            "gc_collections": gc_clock.collections - n0, "device_allocs": allocs() - a0}


def _lag1(xs: list[float]) -> float:
    if len(xs) < 3:
        return float("nan")
    m = statistics.fmean(xs)
    den = sum((x - m) ** 2 for x in xs)
    return sum((a - m) * (b - m) for a, b in zip(xs[:-1], xs[1:], strict=True)) / den if den else 0.0


def summary(steps: list[dict]) -> dict:
    walls = [s["wall_s"] for s in steps]
    q = statistics.quantiles(walls, n=10) if len(walls) >= 2 else [walls[0]] * 9
    median = statistics.median(walls)
    return {"steps": len(walls), "median_s": median, "p10_s": q[0],
            "p90_s": q[-1], "spread": (q[-1] - q[0]) / median,
            "lag1": _lag1(walls),
            "cpu_over_wall": statistics.median(s["cpu_s"] / s["wall_s"] for s in steps),
            "involuntary": sum(s["involuntary"] for s in steps),
            "gc_s": sum(s["gc_s"] for s in steps),
            "device_allocs": sum(s["device_allocs"] for s in steps)}


def probe(step, device: str, n: int, variants, values: list[str], kernels: bool = False,
          ) -> dict:
    clock = _GcClock()
    gc.callbacks.append(clock)
    out: dict[str, list[dict]] = {}
    try:
        for _ in range(3):
            step()
        gc.collect()
        gc.freeze()
        for v in variants:
            if v == "consecutive":
                out[v] = [_timed(step, device, clock) for _ in range(n)]
            elif v == "rounds":
                out[v] = []
                for _ in range(n):
                    gc.collect()
                    step()
                    out[v].append(_timed(step, device, clock))
            elif v == "gc-off":
                gc.disable()
                try:
                    out[v] = [_timed(step, device, clock) for _ in range(n)]
                finally:
                    gc.enable()
            elif v == "pinned":
                before = os.sched_getaffinity(0)
                os.sched_setaffinity(0, {min(before)})
                try:
                    out[v] = [_timed(step, device, clock) for _ in range(n)]
                finally:
                    os.sched_setaffinity(0, before)
            elif v == "toggled":
                for mode in values:
                    out.update(_toggled(step, device, n, mode, clock, kernels))
    finally:
        gc.unfreeze()
        gc.callbacks.remove(clock)
    result: dict = {name: {"summary": summary(steps), "steps": steps}
                    for name, steps in out.items() if not name.startswith("kernels-")}
    result.update({name: rows for name, rows in out.items() if name.startswith("kernels-")})
    for mode in values:
        on, off = out.get(f"toggled-{mode}-on"), out.get(f"toggled-{mode}-off")
        if on:
            pairs = [a["wall_s"] / b["wall_s"] for a, b in zip(on, off, strict=True)]
            result[f"toggled-{mode}-ratio"] = {"median": statistics.median(pairs),
                                              "repeats": pairs}
    return result


def _toggled(step, device: str, n: int, values: str, clock: _GcClock,
             kernels: bool = False) -> dict[str, list]:
    """The sanitizer entered once, ``n`` pairs of steps on and off (``_spread.interleaved``:
    on first in even pairs, off first in odd ones: a trend cancels); ``kernels`` (CUDA): one
    step each way under torch.profiler, its device time by kernel."""
    from benchmarks._sanitize_megatron import switch_of
    from fixes.sanitize import recompute_sanitizer

    def run(state: str, measure=lambda: _timed(step, device, clock)):
        switch(state == "on")
        return measure()

    with recompute_sanitizer(values=values) as sanitizer:
        switch = switch_of(sanitizer)
        for _ in range(2):  # the entry and the first walk of the modules, off the clock
            step()
        got = {f"toggled-{values}-{state}": steps
               for state, steps in interleaved(("on", "off"), run, n).items()}
        if kernels and device == "cuda":
            for state in ("on", "off"):
                got[f"kernels-{values}-{state}"] = run(state, lambda: _kernel_times(step))
    return got


def _kernel_times(step, top: int = 12) -> list[dict]:
    """One step under torch.profiler: the device time of every kernel and copy together
    (``name`` "(all)"), then the ``top`` names by device time (microseconds, calls)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = by_name.setdefault(e.name[:80], [0.0, 0])
            row[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time
            row[1] += 1
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in by_name.values())
    return [{"name": "(all)", "us": total, "calls": sum(v[1] for v in by_name.values())}] + [
        {"name": k, "us": v[0], "calls": v[1]} for k, v in rows[:top]]


def main(argv: list[str] | None = None) -> int:
    from benchmarks._sanitize_megatron import cell_arg, cell_step

    p = argparse.ArgumentParser(prog="python -m benchmarks.step_noise")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cell", action="append", required=True,
                   metavar="MODEL:SIZE:DTYPE:AUX:RECOMPUTE")
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--values", default="none",
                   help="the toggled sanitizer's values modes, comma-separated, of all, "
                   "sampled, none (recompute_sanitizer(values=...): none is the metadata-only "
                   "mode, not \"no sanitizer\"); default: none")
    p.add_argument("--kernels", action="store_true",
                   help="toggled (CUDA): one step on and one off under torch.profiler, the "
                   "device time by kernel")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants: {', '.join(bad) or 'none given'} not allowed; allowed: "
                f"{', '.join(VARIANTS)}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.kernels and (args.device != "cuda" or "toggled" not in variants):
        p.error("--kernels times device kernels of toggled steps: it needs --device cuda and "
                "the toggled variant")
    values = [v for v in args.values.split(",") if v]
    if not values or any(v not in ("all", "sampled", "none") for v in values):
        p.error(f"--values {args.values!r}: allowed: all, sampled, none (comma-separated)")
    results = {}
    for text in args.cell:
        model, size, dtype, aux, recompute = cell_arg(text, p)
        hidden, seq = (int(v) for v in size.split("x"))
        gpt, step = cell_step(model, args.device, hidden, seq, dtype, aux_loss=aux,
                              recompute=recompute)
        results[text] = r = probe(step, args.device, args.steps, variants, values, args.kernels)
        for name, got in r.items():
            if "summary" in got:
                s = got["summary"]
                print(f"STEP-NOISE {text} {name:20s} median {s['median_s'] * 1e3:7.2f} ms  "
                      f"p10-p90 {s['p10_s'] * 1e3:7.2f}-{s['p90_s'] * 1e3:7.2f} "
                      f"({s['spread']:.1%})  lag1 {s['lag1']:+.2f}  cpu/wall "
                      f"{s['cpu_over_wall']:.2f}  invol {s['involuntary']}  gc "
                      f"{s['gc_s'] * 1e3:.1f} ms  device allocs {s['device_allocs']}",
                      flush=True)
        for name, rows in r.items():
            if name.startswith("kernels-"):
                print(f"STEP-NOISE {text} {name}: " + "; ".join(
                    f"{k['name']} {k['us']:.0f} us x{k['calls']}" for k in rows[:6]), flush=True)
        for mode in values:
            if f"toggled-{mode}-ratio" in r:
                print(f"STEP-NOISE {text} toggled {mode}: on/off median ratio "
                      f"{r[f'toggled-{mode}-ratio']['median']:.3f}", flush=True)
        del gpt, step
        gc.collect()
        with contextlib.suppress(Exception):
            import torch

            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "steps": args.steps, "cells": results}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
