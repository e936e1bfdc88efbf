"""Megatron-LM's own unit tests under each recompute reclaim: the outcomes must not depend on it.

A fix that changes no value leaves every test of megatron-core's checkpointing, MTP, transformer
block and MoE as it was: passed, failed, skipped or errored alike (failures included: on one GPU
without TransformerEngine some fail for the environment, TP > 1 or TE, with any reclaim or
none). This runs the given test files of a Megatron-LM checkout (its ``tests/`` tree and its
``pyproject.toml`` -- pytest's configuration and markers -- at the tag of the installed
megatron-core, e.g. ``git archive core_v0.19.0 pyproject.toml tests/__init__.py tests/unit_tests
tests/test_utils`` into an ignored folder) once per reclaim, in a child pytest each, with this module as a pytest plugin that installs the
reclaim at session start (``repro.shared_view_reclaim.install_reclaim``: ``none``, ``ours``,
``verl-0.8.0``, ``verl-0.9.1``), and compares the outcome of every test id::

    python -m benchmarks.megatron_unit_tests --tests .megatron-tests/core_v0.19.0 \\
        --reclaims none,ours,verl-0.8.0,verl-0.9.1 --json results.json

Exit status 0 when every reclaim gives every test the outcome ``none`` gives it, 1 when one
differs (the differences are printed) or a child pytest did not run to its end (interrupted,
an internal error, nothing collected), 2 for bad input. A test file that does not import
there is an ``error`` outcome of the file, compared like any other. Megatron's unit tests need
CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks._child_pytest import comma_choices, run_with_report

DEFAULT_FILES = (
    "tests/unit_tests/tensor_parallel/test_random.py",
    "tests/unit_tests/transformer/test_multi_token_prediction.py",
    "tests/unit_tests/transformer/test_transformer_block.py",
    "tests/unit_tests/transformer/moe/test_moe_layer.py",
)
RECLAIMS = ("none", "ours", "verl-0.8.0", "verl-0.9.1")
OPTION = "--stackfix-reclaim"


# --- the pytest plugin (``-p benchmarks.megatron_unit_tests``) ------------------------------------


def pytest_addoption(parser):
    parser.addoption(OPTION, choices=RECLAIMS, default=None,
                     help="install this recompute reclaim on megatron-core's CheckpointFunction "
                          "for the whole session")


def pytest_configure(config):
    name = config.getoption(OPTION)
    if name is None:
        return
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from fixes.megatron.reclaim import installed_reclaim
    from repro.reclaims import install_reclaim

    install_reclaim(name, CheckpointFunction)
    print(f"stackfix reclaim for this session: {name} (installed: "
          f"{installed_reclaim(CheckpointFunction)})", flush=True)


# --- the runner ------------------------------------------------------------------------------------


def outcomes(junit_xml: str) -> dict[str, str]:
    """Test id (``classname::name``) -> ``passed`` / ``failed`` / ``error`` / ``skipped``, from
    a pytest ``--junitxml`` report."""
    found = {}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        outcome = ("error" if "error" in kinds else "failed" if "failure" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        found[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return found


def differences(by_reclaim: dict[str, dict[str, str]], reference: str = "none") -> list[str]:
    """Every (reclaim, test) whose outcome is not the reference reclaim's, as lines."""
    ref = by_reclaim[reference]
    lines = []
    for name, got in by_reclaim.items():
        for test in sorted(ref.keys() | got.keys()):
            if got.get(test) != ref.get(test):
                lines.append(f"{name}: {test}: {got.get(test, 'absent')} "
                             f"(with {reference}: {ref.get(test, 'absent')})")
    return lines


def run_once(tests: Path, files: list[str], reclaim: str, timeout: float
             ) -> tuple[int, dict[str, str], str]:
    """One child pytest over ``files`` of the checkout ``tests`` with ``reclaim`` installed:
    (exit status, outcomes, log)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    # the checkout first (its ``tests`` package is Megatron-LM's, not stackfix's), then stackfix
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tests), str(repo), env.get("PYTHONPATH", "")) if p)
    # the checkout's own pytest configuration (its markers), not any ini above it
    config = ["-c", str(tests / "pyproject.toml")] if (tests / "pyproject.toml").is_file() else []
    argv = [sys.executable, "-m", "pytest", *files, "-p", "benchmarks.megatron_unit_tests",
            f"{OPTION}={reclaim}", "-p", "no:cacheprovider", "-q", "--tb=line",
            f"--rootdir={tests}", *config, "--continue-on-collection-errors"]
    code, report, log = run_with_report(argv, tests, env, timeout)
    return code, outcomes(report) if report is not None else {}, log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megatron_unit_tests",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", required=True, type=Path,
                   help="a Megatron-LM checkout's root (it holds tests/unit_tests)")
    p.add_argument("--files", default=",".join(DEFAULT_FILES),
                   help="comma-separated test files, relative to --tests")
    p.add_argument("--reclaims", default=",".join(RECLAIMS),
                   help=f"comma-separated, from {', '.join(RECLAIMS)} (none is always run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child pytest")
    p.add_argument("--json", type=Path, help="write outcomes and differences here")
    args = p.parse_args(argv)
    reclaims = comma_choices(p, args.reclaims, RECLAIMS, "none", "reclaim(s)")
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    missing = [f for f in files if not (args.tests / f).is_file()]
    if missing:
        p.error(f"not in {args.tests}: {', '.join(missing)}")
    by_reclaim, codes, tails = {}, {}, {}
    for reclaim in reclaims:
        codes[reclaim], by_reclaim[reclaim], log = run_once(args.tests.resolve(), files, reclaim,
                                                            args.timeout)
        tails[reclaim] = log[-3000:]
        counts = Counter(by_reclaim[reclaim].values())
        print(f"{reclaim:>11}: exit {codes[reclaim]}, " + ", ".join(
            f"{n} {o}" for o, n in sorted(counts.items())), flush=True)
        if codes[reclaim] not in (0, 1) or not by_reclaim[reclaim]:
            print(f"  the run did not finish its tests; its log ends:\n{tails[reclaim]}",
                  flush=True)
    diff = differences(by_reclaim)
    print("\n".join(diff) if diff else "every reclaim: every test's outcome as with none")
    if args.json:
        args.json.write_text(json.dumps({"files": files, "exit": codes, "outcomes": by_reclaim,
                                         "differences": diff, "log_tails": tails}, indent=1))
    unfinished = [r for r in reclaims if codes[r] not in (0, 1) or not by_reclaim[r]]
    return 1 if diff or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
