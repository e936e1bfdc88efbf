"""The recompute sanitizer's host cost per op, next to the floor any dispatch-mode sanitizer
pays: a pass-through ``TorchDispatchMode`` over the same region.

    python -m benchmarks.sanitizer_per_op [--device cuda] [--ops 200] [--modules 0] [--reps 30]
                                          [--clock wall|thread] [--json PATH]

One non-reentrant checkpoint of ``--ops`` tiny ops (``tanh(x @ w)`` on 8x8: launch-bound, so a
step's time is the host's) runs forward and backward (its recompute): without anything, under
a pass-through mode entered around the region's code (forward and recompute), and under
``recompute_sanitizer(values=...)`` in each mode, round by round interleaved over ``--reps``
rounds (load on a shared machine hits all alike). Printed and written as microseconds per op
per side (the forward's record or the recompute's judging), from the medians and from the
minima (the fastest round of each: its cost without interference). With a model's region op
count and step time it bounds what a sanitizer can cost there: a launch-bound step of n
region ops pays at least ``2 n`` times the floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from fixes.sanitize import recompute_sanitizer


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Nest(torch.nn.Module):
    """``fn`` called through ``depth`` nested module calls."""

    def __init__(self, fn, depth: int):
        super().__init__()
        self.fn, self.inner = fn, _Nest(fn, depth - 1) if depth > 1 else None

    def forward(self, t):
        return self.fn(t) if self.inner is None else self.inner(t)


def measure(device: str, ops: int, reps: int, modules: int = 0,
            clock: str = "wall") -> dict[str, float]:
    x = torch.randn(8, 8, device=device, requires_grad=True)
    w = torch.randn(8, 8, device=device, requires_grad=True)
    per_iteration = 2  # mm, tanh
    iterations = ops // per_iteration
    floor = [False]

    def layer(t):
        return torch.tanh(t @ w)

    call = _Nest(layer, modules) if modules else layer

    def body(t):
        with _PassThrough() if floor[0] else contextlib.nullcontext():
            for _ in range(iterations):
                t = call(t)
        return t

    now = time.thread_time if clock == "thread" else time.perf_counter

    def step() -> float:
        start = now()
        checkpoint(body, x, use_reentrant=False).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return now() - start

    configs = {"without": contextlib.nullcontext, "pass-through mode": contextlib.nullcontext}
    for values in ("none", "sampled", "all"):
        configs[f"recompute_sanitizer(values={values!r})"] = (
            lambda v=values: recompute_sanitizer(values=v))
    times: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(reps + 3):  # 3 warm-up rounds
        for name, ctx in configs.items():
            floor[0] = name == "pass-through mode"
            with ctx():
                t = step()
            if round_ >= 3:
                times[name].append(t)
    floor[0] = False
    sides = 2 * iterations * per_iteration

    def per_op(pick) -> dict[str, float]:
        base = pick(times["without"])
        return {k: (pick(v) - base) / sides * 1e6 for k, v in times.items() if k != "without"}

    return {"device": device, "ops": iterations * per_iteration, "modules": modules,
            "rounds": reps, "clock": clock, "step_s": statistics.median(times["without"]),
            "step_min_s": min(times["without"]),
            "us_per_op_side": per_op(statistics.median), "us_per_op_side_min": per_op(min)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sanitizer_per_op",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--modules", type=int, default=0, metavar="N",
                   help="run each op inside N nested nn.Module calls")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: this thread's CPU time (CPU device, one intra-op thread): "
                   "what other processes' load does not add")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.ops < 2 or args.reps < 1 or args.modules < 0:
        p.error("--ops must be >= 2, --reps >= 1 and --modules >= 0")
    if args.clock == "thread" and args.device != "cpu":
        p.error("--clock thread measures the host thread: CPU device only")
    result = measure(args.device, args.ops, args.reps, args.modules, args.clock)
    print(f"{result['ops']} ops in one checkpoint on {args.device}, inside {args.modules} "
          f"nested modules, {result['rounds']} interleaved rounds, {args.clock} clock; "
          "step without: "
          f"{result['step_s'] * 1e3:.2f} ms median, {result['step_min_s'] * 1e3:.2f} ms fastest; "
          "added host time per op per side (median / fastest round):")
    for k, v in result["us_per_op_side"].items():
        print(f"  {k:40} {v:6.1f} us / {result['us_per_op_side_min'][k]:6.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
