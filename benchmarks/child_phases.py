"""Where a crash child's time goes on one device: the fixed start-up costs every child pays, and
each repro path's wall time split into start, its module's import and its run.

    python -m benchmarks.child_phases [--device cuda] [--only NAME ...] [--probes 3] [--json PATH]

Two parts, one after the other (nothing else should run on the machine):

* probes: a fresh child, spawned (``python -c``) and forked from the "torch" fork server, that
  times each start-up phase in turn -- the interpreter reaching its first line (spawn) or the
  fork (server), ``import torch``, ``import spmd_types`` and ``import megatron.core`` (where
  installed), then on CUDA the context (first tensor, synchronised), cuBLAS (first matmul), and
  a one-rank gloo group, and on CUDA a one-rank NCCL group with its first all_reduce;
* paths: every runnable repro's two paths, one at a time as ``python -m repro -j 1`` runs them,
  each reporting (``STACKFIX_CHILD_TIMES=1``, repro.child) when it entered main, had imported its
  module and ended its run; a path that a signal ends reports only its wall time.

It prints one table per part and writes both as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from repro import catalog
from repro.harness import forkserver as forkserver_module
from repro.harness.isolated import run_isolated
from repro.registry import DEVICES, TIMES_ENV, TIMES_MARKER, find
from repro.runner import run_path, skip_reason

# The probe child: each phase prints "PHASE <name> <time.time()>" when it has finished.
_PROBE = r"""
import importlib.util, os, sys, tempfile, time
def mark(name):
    print("PHASE", name, time.time(), flush=True)
mark("start")
import torch
mark("import torch")
if importlib.util.find_spec("spmd_types"):
    import spmd_types
    mark("import spmd_types")
if importlib.util.find_spec("megatron"):
    import megatron.core
    mark("import megatron.core")
device = sys.argv[1]
if device == "cuda":
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    mark("CUDA context")
    a = torch.randn(256, 256, device="cuda"); (a @ a).sum().item()
    mark("first matmul (cuBLAS)")
import torch.distributed as dist
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
t = torch.ones(4); dist.all_reduce(t)
mark("gloo group + all_reduce")
if device == "cuda":
    group = dist.new_group(backend="nccl")
    t = torch.ones(4, device="cuda"); dist.all_reduce(t, group=group); torch.cuda.synchronize()
    mark("NCCL group + all_reduce")
dist.destroy_process_group()
mark("end")
"""


def _probe_once(device: str, forkserver: bool) -> dict[str, float]:
    requested = time.time()
    result = run_isolated(code=_PROBE, args=[device], timeout=300, forkserver=forkserver)
    if not result.ok:
        raise RuntimeError(f"probe child failed ({result.describe()}): {result.stderr[-2000:]}")
    phases, last = {}, requested
    for line in result.stdout.splitlines():
        if line.startswith("PHASE "):
            name, stamp = line[len("PHASE "):].rsplit(" ", 1)
            phases[name], last = float(stamp) - last, float(stamp)
    phases["exit"] = requested + result.seconds - last
    phases["total"] = result.seconds
    return phases


def _warm(profiles) -> None:
    """Start these fork servers (untimed): the first child of each would wait for its imports."""
    for profile in dict.fromkeys(profiles):
        run_isolated(code="pass", timeout=300, forkserver=profile)


def probes(device: str, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds per phase, spawned and forked (only spawned where the "torch" server
    cannot start: ``unavailable`` then says why)."""
    _warm(["torch"])
    out, hows = {}, [("spawned", False)]
    if "torch" in forkserver_module._unavailable:
        out["unavailable"] = forkserver_module._unavailable["torch"]
    else:
        hows.append(("forked", True))
        out["preloads"] = list(forkserver_module._servers["torch"].preloads)
    for how, forkserver in hows:
        runs = [_probe_once(device, forkserver) for _ in range(repeats)]
        out[how] = {k: statistics.median(r[k] for r in runs if k in r) for k in runs[0]}
    return out


def _times(stdout: str) -> dict[str, float] | None:
    for line in stdout.splitlines():
        if line.startswith(TIMES_MARKER):
            return {k: float(v) for k, v in
                    (kv.split("=") for kv in line[len(TIMES_MARKER):].split())}
    return None


def paths(device: str, names: list[str], entries: dict) -> list[dict]:
    """Each runnable repro path's wall time, and its split where the child reported one
    (``entries``: the catalog)."""
    os.environ[TIMES_ENV] = "1"
    names = [n for n in names if skip_reason(entries[n], device) is None]
    _warm(entries[n].forkserver for n in names if entries[n].forkserver)
    rows = []
    for name in names:
        repro = find(name, entries[name].module)
        for fixed in (False, True):
            requested = time.time()
            result = run_path(repro, fixed, device)
            server = repro.forkserver
            if not forkserver_module.enabled() or server in forkserver_module._unavailable:
                server = "spawned"  # fork servers off, or its server could not start here
            row = {"repro": name, "path": "fixed" if fixed else "unfixed",
                   "forkserver": server, "ended": result.describe(),
                   "wall": result.seconds}
            if (t := _times(result.stdout)) is not None:
                row.update(start=t["entered"] - requested, module=t["found"] - t["entered"],
                           run=t["ran"] - t["found"],
                           exit=requested + result.seconds - t["ran"])
            rows.append(row)
    return rows


def _cell(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v if v is not None else "-")


# The paths table: (column, width); text columns left-aligned and cut to their width, the
# seconds right-aligned.
_COLUMNS = (("repro", 30), ("path", 12), ("forkserver", 12), ("ended", 12), ("wall", 10),
            ("start", 10), ("module", 10), ("run", 10), ("exit", 10))
_TEXT_COLUMNS = 4


def _table_line(cells) -> str:
    return " ".join(f"{c[:w]:{w}}" if i < _TEXT_COLUMNS else f"{c:>{w}}"
                    for i, (c, (_, w)) in enumerate(zip(cells, _COLUMNS, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.child_phases",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument("--only", action="append", metavar="NAME")
    parser.add_argument("--probes", type=int, default=3, metavar="N", help="probe repeats (median)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    entries = catalog.load()
    unknown = [n for n in args.only or () if n not in entries]
    if unknown:
        parser.error(f"unknown repro {', '.join(unknown)}; known: {', '.join(entries)}")

    probe = probes(args.device, args.probes)
    print(f"start-up phases on {args.device}, median of {args.probes} (seconds)")
    if "unavailable" in probe:
        print(f"(no forked column: {probe['unavailable']})")
    else:
        print(f"(the forked child's server preloaded {', '.join(probe['preloads'])})")
    hows = [h for h in ("spawned", "forked") if h in probe]
    print(f"{'phase':28} " + " ".join(f"{h:>8}" for h in hows))
    for k in dict.fromkeys(k for h in hows for k in probe[h]):
        print(f"{k:28} " + " ".join(f"{_cell(probe[h].get(k)):>8}" for h in hows))

    rows = paths(args.device, args.only or list(entries), entries)
    print(f"\neach repro path on {args.device}, one at a time (seconds)")
    print(_table_line([c for c, _ in _COLUMNS]))
    for r in rows:
        print(_table_line([_cell(r.get(c)) for c, _ in _COLUMNS]))
    total = sum(r["wall"] for r in rows)
    print(f"\n{len(rows)} paths, {total:.1f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "probes": probe, "paths": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
