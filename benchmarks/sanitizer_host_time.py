"""The recompute sanitizer's own host time per checkpointed region, stage by stage, on a real
megatron-core model (``benchmarks._sanitize_megatron``'s cells).

    python -m benchmarks.sanitizer_host_time --cell moe:128x512:fp32:0.01:moe-layer \
        [--cell ...] [--layers 4] [--values none,sampled,all] [--steps 20] [--rounds 3] \
        [--device cpu|cuda] [--json OUT]

Where a values mode's step-time cost comes from when it is the host's: on the H200 megatron's
MoE synchronises inside every layer (the token dispatcher's ``.tolist()``), so each region's
host work waits for nothing and adds to the step. A step-time ratio on a CPU box cannot
resolve it (a few ms in a 300 ms step, under another process's load); this times the
sanitizer's stages directly, with this thread's CPU time, around the functions each stage is
(none calls another, so the stages add up):

* ``site``: ``RecomputeSanitizer.region`` -- the call site and the region's ``Watch``;
* ``roots``: ``roots_of`` -- the region's function and tensor arguments;
* ``ran``: ``ModulesRun._called`` -- the forward pre-hook recording each module the region's
  forward runs (``_ran``; torch's slower module call while a hook is registered is the
  model's time, not counted here);
* ``forward``: ``Watch._finish_forward`` -- what backward uses of the forward (metadata; the
  fingerprint where printed);
* ``reach``: ``Watch.reached`` -- the tensors the region reaches (the kept walk, ``_reach``);
* ``snapshot``: ``State.__init__`` -- their counters and small tensors' bits at the recompute's
  start;
* ``judge``: ``Watch._judge`` -- the recompute's count, metadata (and fingerprint where
  printed), the state it left (``State.settle``), queued;
* ``flush``: ``RecomputeSanitizer._flush`` -- a backward's checks after its one
  synchronisation per device.

Each stage's figure is its time per region (the flush's spread over the backward's regions).
``--split site,reach,judge`` times, beside them, the parts of those stages (``PARTS``: the
functions each calls; a part can run outside its stage, as ``Reached.of`` does, and parts
contain parts -- ``narrow`` the ``tree``, ``read`` its ``rescan`` and a ``sort`` -- so the
parts need not add up to it, and a part a mode never runs -- the check outside ``all`` -- reads None):
where a stage's time goes on a host this cannot be run on step by step, as the GPU's.
``--layers 2,4,8,16`` builds each cell at each depth: megatron's full recompute checkpoints
one layer per region with the whole block in its closure; a region reaches the layer its
forward ran (``fixes.sanitize._ran``), so a region's host time should not grow with the
depth (it did when every region reached every layer).
``--rounds`` rounds of ``--steps`` steps per mode, the modes interleaved round by round, each
entered once per round and run for a warm-up step first; medians over the rounds. The stages
are internal functions: a stage that no region reached is an error here, not a zero.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator

VALUES = ("all", "sampled", "none")


def _stages() -> dict[str, tuple[object, str]]:
    """stage -> (the object holding its function, the function's name)."""
    from fixes.sanitize import _detect, _ran, _reach
    from fixes.sanitize import recompute as rs

    return {"site": (rs.RecomputeSanitizer, "region"), "roots": (rs, "roots_of"),
            "ran": (_ran.ModulesRun, "_called"),
            "forward": (_detect.Watch, "_finish_forward"), "reach": (_detect.Watch, "reached"),
            "snapshot": (_reach.State, "__init__"), "judge": (_detect.Watch, "_judge"),
            "flush": (rs.RecomputeSanitizer, "_flush")}


STAGES = ("site", "roots", "ran", "forward", "reach", "snapshot", "judge", "flush")


def _parts() -> dict[str, dict[str, tuple[object, str]]]:
    """stage -> its parts (``--split``): part -> (the object holding its function, its name)."""
    from fixes.sanitize import _detect, _reach
    from fixes.sanitize import recompute as rs

    return {"site": {"call_site": (rs, "call_site"), "identity": (rs, "identity"),
                     "watch": (_detect.Watch, "__init__")},
            "reach": {"plan": (_reach.Walks, "_planned"), "roots": (_reach, "_roots"),
                      "narrow": (_reach, "narrowed"), "tree": (_reach.Walks, "_tree"),
                      "check": (_reach._Kept, "check"), "walk": (_reach, "_walk"),
                      "read": (_reach._Kept, "read"), "rescan": (_reach._Scan, "module"),
                      "sort": (_reach.Reached, "of")},
            "judge": {"shape": (_detect.Watch, "_shape_difference"),
                      "settle": (_reach.State, "settle"),
                      "defer": (rs.RecomputeSanitizer, "defer")}}


PARTS = tuple(_parts())  # the stages --split takes


def _table(split: tuple[str, ...] = ()) -> dict[str, tuple[object, str]]:
    """The stages, and the parts of those in ``split`` as ``STAGE.PART``."""
    parts = _parts()
    return {**_stages(), **{f"{stage}.{part}": where for stage in split
                            for part, where in parts[stage].items()}}


@contextlib.contextmanager
def timed_stages(seconds: dict[str, float], calls: dict[str, int],
                 split: tuple[str, ...] = ()) -> Iterator[None]:
    """Each stage's function (and each part of the stages in ``split``) wrapped to add its
    thread time to ``seconds[name]`` and its calls to ``calls[name]`` while entered; the
    originals put back on exit."""
    clock = time.thread_time
    originals = []
    # every function found before any is wrapped: a missing one (KeyError) leaves none wrapped
    found = [(stage, owner, name, owner.__dict__[name])
             for stage, (owner, name) in _table(split).items()]
    for stage, owner, name, original in found:
        originals.append((owner, name, original))

        bound = original.__func__ if isinstance(original, classmethod) else original

        def timed(*args, __f=bound, __stage=stage, **kwargs):
            start = clock()
            try:
                return __f(*args, **kwargs)
            finally:
                seconds[__stage] += clock() - start
                calls[__stage] += 1

        # The sanitizer's call site skips frozen frames: a region's is its caller's, not
        # this wrapper's (wrapped around ``call_site`` or ``region``, it was the wrapper's line)
        timed.__code__ = timed.__code__.replace(co_filename=f"<frozen {__name__}>")
        timed = functools.wraps(bound)(timed)
        setattr(owner, name, classmethod(timed) if isinstance(original, classmethod) else timed)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def host_time(step: Callable[[], object], values: tuple[str, ...] = VALUES, steps: int = 20,
              rounds: int = 3, split: tuple[str, ...] = ()) -> dict:
    """Per values mode: regions a step and, per stage (``STAGES``) and in all, the median over
    ``rounds`` of the sanitizer's host microseconds per region; with ``split``, per part of
    those stages too (``us_per_region_by_part``: None for a part that mode never ran -- a
    rescan where the model rebinds no tensor). ValueError if a stage ran in no region of any
    mode (a function no longer called: nothing would be measured there; a renamed one is a
    KeyError)."""
    from fixes.sanitize import recompute_sanitizer

    names = list(_table(split))  # the stages, then the parts
    runs: dict[str, list[dict]] = {v: [] for v in values}
    for _ in range(rounds):
        for v in values:
            seconds = dict.fromkeys(names, 0.0)
            calls = dict.fromkeys(names, 0)
            with recompute_sanitizer(values=v) as sanitizer:
                step()  # entered, walked: the timed steps are a training run's
                regions, recorded = sanitizer.regions, sanitizer.modules_recorded
                with timed_stages(seconds, calls, split):
                    for _ in range(steps):
                        step()
                regions = sanitizer.regions - regions
                recorded = sanitizer.modules_recorded - recorded
            if regions == 0:
                raise ValueError("sanitizer_host_time: the step ran no checkpointed region")
            runs[v].append({"regions": regions, "seconds": seconds, "calls": calls,
                            "recorded": recorded})
    # ``ran`` records a region's modules only where no recent record of its identity is kept:
    # in sampled and none, none after the first step (``_reach.Walks.ran``); in all, each forward
    required = [s for s in STAGES if s != "ran" or "all" in runs]
    if missing := [s for s in required if not any(r["calls"][s] for rs in runs.values()
                                                  for r in rs)]:
        raise ValueError(f"sanitizer_host_time: no region called the function(s) of stage(s) "
                         f"{', '.join(missing)}: renamed, or no longer called")
    parts = names[len(STAGES):]
    out = {}
    for v, rs in runs.items():
        per = {s: statistics.median(r["seconds"][s] / r["regions"] * 1e6 for r in rs)
               for s in STAGES}
        totals = [sum(r["seconds"][s] for s in STAGES) / r["regions"] * 1e6 for r in rs]
        out[v] = {"regions_per_step": rs[0]["regions"] / steps,
                  "us_per_region": statistics.median(totals), "us_per_region_by_stage": per,
                  "us_per_region_repeats": totals,
                  # records of the modules a forward ran kept (``modules_recorded``) per timed
                  # region: the regions whose identity (``fixes.sanitize._ran.identity``) had
                  # no recent record (in all, none with the same modules) -- each of them also
                  # finds what its function reaches again
                  "recorded_per_region": sum(r["recorded"] for r in rs)
                  / sum(r["regions"] for r in rs)}
        if parts:
            out[v]["us_per_region_by_part"] = {
                p: (statistics.median(r["seconds"][p] / r["regions"] * 1e6 for r in rs)
                    if any(r["calls"][p] for r in rs) else None) for p in parts}
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks._sanitize_megatron import cell_arg

    p = argparse.ArgumentParser(prog="python -m benchmarks.sanitizer_host_time",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cell", action="append", default=[], metavar="MODEL:SIZE:DTYPE:AUX:RECOMPUTE",
                   help="a cell of benchmarks._sanitize_megatron (repeatable; required)")
    p.add_argument("--layers", default="4",
                   help="transformer layers of each cell, comma-separated (one build each)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--values", default=",".join(VALUES),
                   help=f"values modes, comma-separated, of {', '.join(VALUES)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (modes interleaved)")
    p.add_argument("--split", default="", metavar="STAGES",
                   help=f"also time the parts of these stages, comma-separated, of "
                        f"{', '.join(PARTS)}")
    p.add_argument("--json", metavar="PATH", help="write every cell's figures here")
    args = p.parse_args(argv)
    values = tuple(args.values.split(","))
    split = tuple(s for s in args.split.split(",") if s)
    if any(s not in PARTS for s in split):
        p.error(f"--split {args.split!r}: allowed: {', '.join(PARTS)}")
    if not args.cell:
        p.error("give at least one --cell MODEL:SIZE:DTYPE:AUX:RECOMPUTE")
    if not values or any(v not in VALUES for v in values):
        p.error(f"--values {args.values!r}: allowed: {', '.join(VALUES)}")
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    cells = [cell_arg(c, p) for c in args.cell]
    depths = args.layers.split(",")
    if not all(d.isdigit() and int(d) >= 1 for d in depths):
        p.error(f"--layers {args.layers!r}: positive integers, comma-separated (e.g. 2,4,8)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    if args.device == "cpu":
        torch.set_num_threads(1)  # the host's own work, not the intra-op pool's
    from benchmarks._sanitize_megatron import cell_step

    results = []
    for (text, (model, size, dtype, aux, recompute)), layers in itertools.product(
            zip(args.cell, cells, strict=True), map(int, depths)):
        hidden, seq = (int(v) for v in size.split("x"))
        gpt, step = cell_step(model, args.device, hidden, seq, dtype, aux_loss=aux,
                              recompute=recompute, layers=layers)
        result = {"cell": text, "layers": layers, "device": args.device, "steps": args.steps,
                  "rounds": args.rounds, "modes": host_time(step, values, args.steps,
                                                            args.rounds, split)}
        results.append(result)
        for v, m in result["modes"].items():
            stages = ", ".join(f"{s} {us:.0f}" for s, us in m["us_per_region_by_stage"].items())
            parts = ", ".join(f"{p} {'--' if us is None else f'{us:.0f}'}"
                              for p, us in m.get("us_per_region_by_part", {}).items())
            print(f"{text} layers={layers} values={v}: {m['us_per_region']:.0f} us/region "
                  f"({m['regions_per_step']:.0f} regions/step, "
                  f"{m['recorded_per_region']:.2f} recorded; {stages})"
                  + (f"; parts: {parts}" if parts else ""), flush=True)
        del gpt, step  # this build goes before the next
        gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
