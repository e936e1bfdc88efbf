"""An upstream test suite run in a child pytest, its outcomes read from a ``--junitxml`` report
(``benchmarks.peer_suites``: PyTorch's checkpoint tests per sanitizer mode;
``benchmarks.megatron_unit_tests``: megatron-core's per reclaim), and the runs its command line
asks for. Standard library only."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def run_with_report(argv: list[str], cwd: Path, env: dict[str, str], timeout: float
                    ) -> tuple[int, str | None, str]:
    """``argv`` (a pytest command line) with ``--junitxml`` added: (exit status, the report's
    XML or None where the child wrote none, its stdout and stderr); 124 on a timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        try:
            done = subprocess.run([*argv, f"--junitxml={report}"], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=timeout)
            code, log = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            code, log = 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
        return code, report.read_text() if report.is_file() else None, log


def comma_choices(parser, text: str, allowed, base: str, what: str) -> list[str]:
    """``text``'s comma-separated choices with ``base`` first (always run: the others are
    compared with it); ``parser.error`` names the allowed ones on an unknown choice."""
    picked = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in picked if c not in allowed]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return [base, *(c for c in picked if c != base)]
