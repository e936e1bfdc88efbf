"""The recompute sanitizer's host cost per op, next to the floor any dispatch-mode sanitizer
pays: a pass-through ``TorchDispatchMode`` over the same region.

    python -m benchmarks.sanitizer_per_op [--device cuda] [--ops 200] [--modules 0] [--reps 30]
                                          [--json PATH]

One non-reentrant checkpoint of ``--ops`` tiny ops (``tanh(x @ w)`` on 8x8: launch-bound, so a
step's time is the host's) runs forward and backward (its recompute), medians over ``--reps``
steps: without anything, under a pass-through mode entered around the region's code (forward
and recompute), and under ``recompute_sanitizer(values=...)`` in each mode. Printed and written
as microseconds per op per side (the forward's record or the recompute's compare). With a
model's region op count and step time it bounds what a sanitizer can cost there: a
launch-bound step of n region ops pays at least ``2 n`` times the floor.
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


def measure(device: str, ops: int, reps: int, modules: int = 0) -> dict[str, float]:
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

    def step() -> float:
        start = time.perf_counter()
        checkpoint(body, x, use_reentrant=False).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def median(ctx) -> float:
        for _ in range(3):  # warm-up (and the sanitizer's first recompute per call site)
            with ctx():
                step()
        times = []
        for _ in range(reps):
            with ctx():
                times.append(step())
        return statistics.median(times)

    base = median(contextlib.nullcontext)
    floor[0] = True
    out = {"pass-through mode": median(contextlib.nullcontext)}
    floor[0] = False
    for values in ("none", "sampled", "all"):
        out[f"recompute_sanitizer(values={values!r})"] = median(
            lambda v=values: recompute_sanitizer(values=v))
    sides = 2 * iterations * per_iteration
    return {"device": device, "ops": iterations * per_iteration, "modules": modules,
            "step_s": base,
            "us_per_op_side": {k: (t - base) / sides * 1e6 for k, t in out.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sanitizer_per_op",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--modules", type=int, default=0, metavar="N",
                   help="run each op inside N nested nn.Module calls")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.ops < 2 or args.reps < 1 or args.modules < 0:
        p.error("--ops must be >= 2, --reps >= 1 and --modules >= 0")
    result = measure(args.device, args.ops, args.reps, args.modules)
    print(f"{result['ops']} ops in one checkpoint on {args.device}, inside {args.modules} "
          f"nested modules; step without: "
          f"{result['step_s'] * 1e3:.2f} ms; added host time per op per side:")
    for k, v in result["us_per_op_side"].items():
        print(f"  {k:40} {v:6.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
