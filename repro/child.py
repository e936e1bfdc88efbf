"""Child-process entry: ``python -m repro.child NAME --fixed|--unfixed --device D``.

Runs one repro in this interpreter. An exception is printed and reported on a marker line
(class names of its MRO and its message) so that the parent can match it exactly; a
``Skipped`` is reported on its own marker line with exit status 77."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from repro.harness.sanitize import sanitizers_from_env
from repro.registry import (
    DEVICES,
    EXCEPTION_MARKER,
    SKIP_EXIT_CODE,
    SKIP_MARKER,
    TIMES_ENV,
    TIMES_MARKER,
    Skipped,
    exception_report,
    find,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.child")
    parser.add_argument("name")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fixed", action="store_true")
    mode.add_argument("--unfixed", action="store_true")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--module", help="the module declaring NAME (default: discover them all)")
    args = parser.parse_args(argv)
    entered = time.time()
    repro = find(args.name, args.module)
    found = time.time()
    try:
        return _run(repro, args)
    finally:
        if os.environ.get(TIMES_ENV) == "1":  # benchmarks/child_phases.py: where the time goes
            print(TIMES_MARKER + f"entered={entered} found={found} ran={time.time()}", flush=True)


def _run(repro, args) -> int:
    try:
        with sanitizers_from_env():  # STACKFIX_SANITIZE=1 (python -m repro --sanitize)
            repro.run(args.fixed, args.device)
    except Skipped as skip:
        print(SKIP_MARKER + " ".join(str(skip).split()), file=sys.stderr, flush=True)
        return SKIP_EXIT_CODE
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        traceback.print_exc()
        print(EXCEPTION_MARKER + exception_report(exc), file=sys.stderr, flush=True)
        return 1
    print(f"REPRO-OK {args.name} {'fixed' if args.fixed else 'unfixed'} {args.device}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
