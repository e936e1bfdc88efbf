"""Failures of the rank processes of a multi-process repro, passed on to the repro's child:
a rank reports its exception on the same marker line as ``repro.child``, and the parent
re-raises the first one reported, so the runner matches the rank's own exception type."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator, Sequence

from repro.harness.isolated_result import IsolatedResult
from repro.registry import EXCEPTION_MARKER, ReportedFailure, exception_report, reported_exception


@contextlib.contextmanager
def reporting_rank() -> Iterator[None]:
    """Around a rank's work: an exception is printed with its marker line, then re-raised."""
    try:
        yield
    except BaseException as exc:
        traceback.print_exc()
        print(EXCEPTION_MARKER + exception_report(exc), file=sys.stderr, flush=True)
        raise


def raise_for_ranks(ranks: Sequence[IsolatedResult]) -> None:
    """Raise the first exception a failed rank reported (ReportedFailure), or a RuntimeError
    describing the ranks when none did (a signal, a timeout)."""
    for rank, result in enumerate(ranks):
        if not result.ok and (report := reported_exception(result.stderr)) is not None:
            raise ReportedFailure(report, where=f"rank {rank}")
    if not all(result.ok for result in ranks):
        raise RuntimeError(f"a rank failed: {[r.describe() for r in ranks]} (see stderr above)")


def run_rank_workers(module: str, fixed: bool, world: int, timeout: float,
                     extra_args: Sequence[str] = ()) -> dict:
    """``world`` loopback ranks of ``python -m module --worker --fixed|--unfixed --out F``
    (plus ``extra_args``); their stderr passed through, a failed rank's exception raised, and
    the JSON result the ranks wrote to F returned."""
    import json
    import os
    import tempfile

    from repro.harness import forkserver
    from repro.harness.isolated import run_loopback_ranks

    with tempfile.TemporaryDirectory(prefix="stackfix-ranks-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, "-m", module, "--worker", "--fixed" if fixed else "--unfixed",
                *extra_args, "--out", out]
        # Forked by the fork server when this child was (its server is at hand); else spawned.
        ranks = run_loopback_ranks(argv, world, timeout=timeout, env={"OMP_NUM_THREADS": "1"},
                                   forkserver=forkserver.attached())
        for rank in ranks:
            sys.stderr.write(rank.stderr)
        raise_for_ranks(ranks)
        with open(out) as f:
            return json.load(f)


def rank_repro_main(prog: str, argv, run, worker, devices: Sequence[str] = ()) -> int:
    """The command line of a multi-process repro module: ``--fixed|--unfixed`` runs the repro
    (``run(fixed, device)``); ``--worker --out F`` is one rank (``worker(fixed, [device,] F)``),
    under ``reporting_rank`` and the sanitizers ``STACKFIX_SANITIZE`` asks for. ``devices``:
    the ``--device`` choices, none for a CPU-only repro."""
    import argparse

    from repro.harness.sanitize import sanitizers_from_env

    parser = argparse.ArgumentParser(prog=prog)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--fixed", action="store_true")
    side.add_argument("--unfixed", action="store_true")
    if devices:
        parser.add_argument("--device", choices=tuple(devices), default=devices[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = args.device if devices else "cpu"
    if args.worker:
        with reporting_rank(), sanitizers_from_env():
            worker(args.fixed, *((device,) if devices else ()), args.out)
    else:
        run(args.fixed, device)
    return 0
