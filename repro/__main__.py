"""python -m repro: every repro, unfixed and fixed, each in its own child interpreter.

Each repro ends good (the unfixed path reproduced its crash and the fixed path passed), bad
(anything else that ran), or skipped (it could not run here: no variant for this device, or a
package, checkout or GPU it needs is missing; the reason is printed). Skipped is never good.

Exit status:
  0  nothing bad; every repro named with --only ran
  1  at least one repro was bad
  2  bad arguments (unknown repro or device, CUDA asked for but absent, --json not writable)
     or a bad STACKFIX_* variable (repro.harness.environment)
  3  nothing bad, but a repro named with --only was skipped (with --strict: any repro that
     has a variant for this device was skipped, but those named with --allow-skip)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

# Only torch-free modules here: --help, --list and bad arguments answer from repro/catalog.json
# without importing a repro module (tests/test_cli_imports.py checks sys.modules).
from repro import catalog
from repro.harness import environment, forkserver
from repro.registry import DEVICES, find
from repro.runner import ReproOutcome, run_repro, skip_reason, skipped_outcome

TABLE_WIDTH = 120  # the detail column is cut to fit; --json keeps every message whole
_HEADER = ["repro", "device", "unfixed", "fixed", "secs", "detail"]


def _detail(o: ReproOutcome) -> str:
    """The one message that matters for a row: the skip reason, the bad path's failure, or
    (good) the crash the unfixed path reproduced."""
    if o.status == "good":
        return o.unfixed.detail
    for path, ok in ((o.unfixed, "reproduced"), (o.fixed, "passed")):
        if path.status not in (ok, "skipped"):
            return path.detail
    return o.unfixed.detail if o.unfixed.status == "skipped" else o.fixed.detail


def _row(o: ReproOutcome) -> list[str]:
    return [o.name, o.device, o.unfixed.status, o.fixed.status,
            f"{o.unfixed.seconds + o.fixed.seconds:.1f}", " ".join(_detail(o).split())]


def _key(o: ReproOutcome) -> str:
    """The distinctive fragment of the row's detail (a good row: what its signature matched)."""
    return o.unfixed.key if o.status == "good" else ""


def shorten(detail: str, key: str, room: int) -> str:
    """``detail`` cut to ``room`` characters; when the cut would lose ``key`` (the part that
    identifies the failure), ``Type: …key and what follows…`` instead."""
    if len(detail) <= room:
        return detail
    at = detail.find(key) if key else -1
    if at + len(key) > room - 1:
        head, sep, _ = detail.partition(": ")
        prefix = f"{head}: …" if sep and len(head) < at else "…"
        detail = prefix + detail[at:]
        if len(detail) <= room:
            return detail
    return detail[: room - 1] + "…"


def table(outcomes: list[ReproOutcome], width: int = TABLE_WIDTH) -> str:
    rows = [_HEADER] + [_row(o) for o in outcomes]
    keys = [""] + [_key(o) for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER) - 1)]
    room = max(width - sum(widths) - 2 * len(widths), 20)
    lines = []
    for r, key in zip(rows, keys, strict=True):
        detail = shorten(r[-1], key, room)
        lines.append("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), detail]))
    lines.insert(1, "  ".join("-" * w for w in [*widths, min(room, 40)]))
    return "\n".join(line.rstrip() for line in lines)


def summary(outcomes: list[ReproOutcome]) -> str:
    by = {s: [o.name for o in outcomes if o.status == s] for s in ("good", "bad", "skipped")}
    text = f"{len(by['good'])} good, {len(by['bad'])} bad, {len(by['skipped'])} skipped"
    if by["bad"]:
        text += "\nbad: " + ", ".join(by["bad"])
    if by["skipped"]:
        reasons: dict[str, list[str]] = {}  # each distinct reason once, in first-seen order
        for o in outcomes:
            if o.status == "skipped":
                reasons.setdefault(" ".join(_detail(o).split()), []).append(o.name)
        text += "\nskipped:" + "".join(f"\n  {', '.join(n)}: {why}" for why, n in reasons.items())
    return text


def exit_status(outcomes: list[ReproOutcome], asked: list[str], strict: bool,
                allowed: tuple[str, ...] = ()) -> int:
    if any(o.status == "bad" for o in outcomes):
        return 1
    for o in outcomes:
        if o.status != "skipped":
            continue
        no_variant = o.unfixed.detail == f"no {o.device} variant"
        if o.name in asked or (strict and not no_variant and o.name not in allowed):
            return 3
    return 0


def _writable(path: str) -> str | None:
    """Why ``path`` cannot be written, or None (checked before any repro runs)."""
    if not path:
        return "an empty path"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory"
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path} is not writable"
    return None


# -j default on CUDA: one child per this much GPU memory (the largest CUDA repro here, a tiny
# megatron GPT, peaks far below it; the CUDA context alone is ~0.5 GiB) and per two host cores
# (each child's CPU side: interpreter, imports, kernel launches), at most 8.
CUDA_BYTES_PER_JOB = 16 << 30
MAX_DEFAULT_JOBS = 8


def default_jobs(device: str, gpu_bytes: int = 0, cores: int = 1) -> int:
    """How many repros run side by side when -j is not given: 1 on CPU (children there compete
    for the same cores they measure on); on CUDA, from the GPU's memory and the host's cores."""
    if device != "cuda":
        return 1
    return max(1, min(gpu_bytes // CUDA_BYTES_PER_JOB, cores // 2, MAX_DEFAULT_JOBS))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (N >= 1)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# The project's own dependencies (pyproject.toml's [project] dependencies): every repro module
# imports them, so a Python without them (not the tox env, not an install of the project) is
# told how to get them instead of a ModuleNotFoundError from the first repro module.
BASE_MODULES = ("torch", "spmd_types")


def _missing_base_modules() -> list[str]:
    missing = []
    for name in BASE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m repro", description=__doc__.split("\n\n")[0].split(": ", 1)[1].capitalize(),
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--list", action="store_true", help="list the repros and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only NAME (repeatable)")
    parser.add_argument("--device", default="cpu", help=f"one of {', '.join(DEVICES)} (default cpu)")
    parser.add_argument("--json", metavar="PATH", help="also write every outcome, messages whole, as JSON")
    parser.add_argument("--strict", action="store_true",
                        help="exit 3 when any repro with a variant for this device was skipped")
    parser.add_argument("--allow-skip", action="append", default=[], metavar="NAME",
                        help="with --strict: NAME may skip (repeatable; e.g. the repros that "
                        "need a Megatron-LM checkout where none can be had)")
    parser.add_argument("--sanitize", action="store_true",
                        help="run every path (and the ranks it starts) under the fixes.sanitize "
                        "sanitizers the repro declares (storage and mesh unless it names "
                        "others, e.g. recompute); unfixed paths must then fail with the named "
                        "error the repro declares (e.g. ReleasedStorageError)")
    parser.add_argument("-j", "--jobs", type=_positive, metavar="N",
                        help="run N repros side by side, each its own children (default 1 on "
                        "cpu; on cuda chosen from the GPU's memory and the host's cores)")
    args = parser.parse_args(argv)

    if args.device not in DEVICES:
        print(f"error: unknown device {args.device!r}; allowed: {', '.join(DEVICES)}", file=sys.stderr)
        return 2
    repros = catalog.load()
    names = args.only or list(repros)
    unknown = [n for n in [*names, *args.allow_skip] if n not in repros]
    if unknown:
        print(f"error: unknown repro {', '.join(map(repr, unknown))}; known: {', '.join(repros)}",
              file=sys.stderr)
        return 2
    if args.list:
        for name in names:
            r = repros[name]
            print(f"{r.name:34} [{','.join(r.devices)}] {r.summary}")
        return 0
    if args.json is not None and (why := _writable(args.json)):
        print(f"error: --json {args.json!r}: {why}", file=sys.stderr)
        return 2
    if missing := _missing_base_modules():
        print(f"error: {', '.join(missing)} cannot be imported by this Python ({sys.executable}): "
              "run the repros with `tox -e repro` (README), or install the project here: "
              "pip install -e '.[torchtitan,remat,megatron]'", file=sys.stderr)
        return 2
    if problems := environment.problems():
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda asked for, but torch.cuda.is_available() is False",
                  file=sys.stderr)
            return 2
        jobs = args.jobs or default_jobs(
            "cuda", torch.cuda.get_device_properties(0).total_memory, os.cpu_count() or 1)
    else:
        jobs = args.jobs or default_jobs(args.device)

    # Known before any import or child (the catalog): why a repro cannot run here, or None.
    reasons = {n: skip_reason(repros[n], args.device) for n in names}
    runnable = [n for n in names if reasons[n] is None]
    # The fork servers start now, their imports overlapping the declaring modules' below.
    forkserver.prestart(repros[n].forkserver for n in runnable if repros[n].forkserver)

    def run_one(name: str) -> ReproOutcome:
        if reasons[name] is not None:  # no import, no child
            o = skipped_outcome(name, args.device, reasons[name], args.sanitize)
        else:
            o = run_repro(find(name, repros[name].module), args.device, sanitized=args.sanitize)
        print(f"[{o.status}] {name} ({args.device}{', sanitized' if args.sanitize else ''})",
              file=sys.stderr, flush=True)
        return o

    # Each repro's paths stay sequential and each path is its own child process; -j only lets
    # several repros' children run at once. The table keeps the order asked for.
    if jobs == 1:
        outcomes = [run_one(name) for name in names]
    else:
        for name in runnable:  # import the declaring modules here, not racing in the threads
            find(name, repros[name].module)
        print(f"running up to {jobs} repros side by side (-j {jobs})", file=sys.stderr)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(pool.map(run_one, names))
    width = min(TABLE_WIDTH, shutil.get_terminal_size((TABLE_WIDTH, 24)).columns)
    if args.sanitize:
        print("under fixes.sanitize (each repro's sanitizers; storage + mesh unless it names "
              "others)\n")
    print(table(outcomes, max(width, 80)))
    print("\n" + summary(outcomes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([o.as_dict() for o in outcomes], f, indent=2)
    return exit_status(outcomes, args.only or [], args.strict, tuple(args.allow_skip))


if __name__ == "__main__":
    sys.exit(main())
