"""The reclaim's own CPU time per checkpoint: time inside the installed backward minus the time
of the backward it wraps, on tiny layers where nothing else hides it (launch-bound GPU steps pay
it one for one).

    python benchmarks/reclaim_overhead.py [--checkpoints 6] [--steps 300] [--cases ...] [--json PATH]

It installs the reclaim with ``apply_recompute_reclaim_patch`` on PyTorch's reentrant
``CheckpointFunction`` (no megatron needed) and times the wrapped backward through the closure
cell the installed wrapper calls it by, so it measures whatever ``fixes`` is first on the path:
run it with another checkout first on ``PYTHONPATH`` to compare two implementations on one
machine. Cases: ``no-leak`` (nothing holds the checkpoint's detached copy after its backward)
and ``leak`` (the layer keeps a recompute intermediate, Megatron-LM #3221). Medians over steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as tcp
from torch import nn

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after a PYTHONPATH checkout

from fixes.megatron import apply_recompute_reclaim_patch  # noqa: E402
from repro.harness.leaks import ModuleStateLeak  # noqa: E402

TARGET = tcp.CheckpointFunction
CASES = ("no-leak", "leak")


class _Layer(nn.Module):
    def __init__(self, leak: ModuleStateLeak | None):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.leak = leak

    def forward(self, t):
        out = self.lin(t).tanh()
        if self.leak is not None:
            self.leak.keep(out)
        return out


def _install_timers() -> tuple[list[int], list[int]]:
    """Install the reclaim; return (ns per call of the installed backward, ns of the wrapped)."""
    apply_recompute_reclaim_patch(TARGET)
    installed = TARGET.__dict__["backward"].__func__
    own = installed.__wrapped__
    cell = next(c for c in installed.__closure__ if c.cell_contents is own)
    outer, inner = [], []
    cell.cell_contents = _timed(own, inner)
    TARGET.backward = staticmethod(_timed(installed, outer))
    return outer, inner


def _timed(backward, into: list[int]):
    """``backward``, appending the ns of each call to ``into``."""

    def timed(ctx, *grads):
        t0 = time.perf_counter_ns()
        try:
            return backward(ctx, *grads)
        finally:
            into.append(time.perf_counter_ns() - t0)

    return timed


def measure(case: str, checkpoints: int, steps: int) -> dict:
    leak = ModuleStateLeak() if case == "leak" else None
    torch.manual_seed(0)
    layers = [_Layer(leak) for _ in range(checkpoints)]
    x = torch.randn(8, 16, requires_grad=True)
    original = TARGET.__dict__["backward"]
    outer, inner = _install_timers()
    per_step = []
    for _ in range(steps + 10):  # 10 warm-up steps
        outer.clear()
        inner.clear()
        h = x
        for layer in layers:
            h = tcp.checkpoint(layer, h, use_reentrant=True)
        h.sum().backward()
        if leak is not None:
            leak.clear()  # the module's next forward
        per_step.append((sum(outer) - sum(inner)) / checkpoints / 1e3)
    TARGET.backward = original
    own_us = statistics.median(per_step[10:])
    return {"case": case, "checkpoints": checkpoints, "steps": steps,
            "reclaim_us_per_checkpoint": round(own_us, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, of {', '.join(CASES)} (one per process for a checkout "
                   "whose reclaim cannot be installed twice)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.checkpoints < 1 or args.steps < 1:
        p.error("--checkpoints and --steps must be >= 1")
    cases = args.cases.split(",")
    if not set(cases) <= set(CASES):
        p.error(f"--cases takes {', '.join(CASES)}; got {args.cases!r}")
    import fixes

    torch.set_num_threads(1)
    rows = [measure(case, args.checkpoints, args.steps) for case in cases]
    for row in rows:
        row["fixes"] = str(Path(fixes.__file__).parent)
        print(f"{row['case']:8s} {row['reclaim_us_per_checkpoint']:8.2f} us per checkpoint"
              f"  ({row['fixes']})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
