"""A benchmark cell measured in a child of its own: a family module's ``print_figures``, in a
child forked by the fork server (``repro.harness.forkserver``: torch and megatron-core imported
once -- a spawned child's start was most of a cell's time), its figures read back from the line
it prints after the family's marker. The reclaim and output-discard families use it."""

from __future__ import annotations

import json
from pathlib import Path

from repro.harness.isolated_result import IsolatedResult

REPO = Path(__file__).resolve().parent.parent


def run_figures(module: str, marker: str, args: tuple) -> tuple[IsolatedResult, dict | None]:
    """``benchmarks.<module>.print_figures(*args)`` in a forked child: its result, and the
    figures on the last line it printed after ``marker`` (None where it failed or printed
    none). Raises repro.Skipped where the child reported a skip (a verl release not
    installed)."""
    from repro import Skipped, run_isolated
    from repro.registry import reported_skip

    code = (f"from benchmarks import {module}\n"
            f"{module}.print_figures({', '.join(map(repr, args))})\n")
    r = run_isolated(code=code, timeout=600, cwd=str(REPO), forkserver=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(marker)]
    if r.ok and lines:
        return r, json.loads(lines[-1][len(marker):])
    skipped = reported_skip(r.stderr)
    if skipped is not None:
        raise Skipped(skipped)
    return r, None
