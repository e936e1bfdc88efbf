"""Failures of the rank processes of a multi-process repro, passed on to the repro's child:
a rank reports its exception on the same marker line as ``repro.child``, and the parent
re-raises the first one reported, so the runner matches the rank's own exception type."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator, Sequence

from repro.harness.isolated import IsolatedResult
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
