"""PyTorch's own checkpoint tests with and without ``--stackfix-sanitize=recompute``.

The recompute sanitizer may only change a test's outcome where the test's recompute really
computes something else than its forward. This runs PyTorch's checkpoint tests (``TESTS``:
``test/test_utils.py``'s TestCheckpoint, the checkpoint tests of ``test/test_autograd.py`` --
TestAutograd's, TestNestedCheckpoint, TestSelectiveActivationCheckpoint -- and
``test/distributed/_composable/test_checkpoint.py``) from a PyTorch checkout, once per mode in a
child pytest each (``off``: no sanitizer; ``all`` / ``sampled`` / ``none``: the plugin's
``--stackfix-sanitize=recompute[:MODE]``), and compares every test's outcome with ``off``'s::

    python -m benchmarks.peer_suites fetch .upstream/pytorch      # needs git and the network
    python -m benchmarks.peer_suites --pytorch-tests .upstream/pytorch \\
        [--modes off,all,sampled,none] [--out results.json]
    python -m benchmarks.peer_suites finding [--out finding.json]  # the known finding's figures

``fetch`` makes a sparse, shallow checkout of the test files at the commit the installed torch
was built from (``torch.version.git_version``); any checkout of the same version will do
(``git clone --depth 1 --branch vX.Y.Z``). The files are never part of this repository: keep
them in an ignored folder (``.upstream/``). The tests need ``expecttest`` (the ``peer`` extra);
``torch.testing._internal`` ships in the torch wheel.

A difference is either a known finding (``KNOWN_FINDINGS``: a test whose recompute is really
wrong, which the sanitizer must name in ``all``) or a defect of the sanitizer. Exit status 0
when every other test has ``off``'s outcome in every mode and each known finding fails in
``all`` with the sanitizer's ``RecomputeMismatchError``; 1 otherwise (the differences are
printed); 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks._child_pytest import comma_choices, run_with_report

# What runs: pytest arguments relative to the checkout, and the -k that picks the checkpoint
# tests of test_autograd.py (case-insensitive: the two classes and TestAutograd's tests whose
# name says checkpoint; the composable file's name matches, so all of it runs).
TESTS = ("test/test_utils.py::TestCheckpoint", "test/test_autograd.py",
         "test/distributed/_composable/test_checkpoint.py")
SELECT = "checkpoint"
# What ``fetch`` checks out: the files above and what test_autograd.py imports beside it.
SPARSE = ("test/test_utils.py", "test/test_autograd.py", "test/autograd",
          "test/distributed/_composable/test_checkpoint.py")
MODES = ("off", "all", "sampled", "none")
FLAG = "--stackfix-sanitize"

# test id (``test/FILE.py::CLASS::NAME``) -> why its outcome changes under the sanitizer
KNOWN_FINDINGS = {
    "test/test_autograd.py::TestSelectiveActivationCheckpoint::test_version_counter": (
        "with allow_cache_entry_mutation=True the recompute applies mul_ a second time to the "
        "cached output of sin, so the gradient is wrong; the test checks only that nothing "
        "raises"),
}
SANITIZER_ERROR = "RecomputeMismatchError"


def mode_flags(mode: str) -> list[str]:
    """The pytest arguments that select ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "off":
        return []
    return [f"{FLAG}=recompute" + ("" if mode == "all" else f":{mode}")]


def outcomes(junit_xml: str) -> dict[str, dict[str, str]]:
    """Test id (``test/FILE.py::CLASS::NAME``) -> {outcome, message} from a pytest ``--junitxml``
    report; outcome is ``passed`` / ``failed`` / ``error`` / ``skipped``, message the failure's,
    error's or skip's first line."""
    found = {}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        test = f"{module.replace('.', '/')}.py::{cls}::{case.get('name')}"
        kinds = {child.tag: child for child in case if child.tag in ("failure", "error",
                                                                       "skipped")}
        outcome = next((o for o, tag in (("error", "error"), ("failed", "failure"),
                                         ("skipped", "skipped")) if tag in kinds), "passed")
        child = kinds.get({"error": "error", "failed": "failure",
                           "skipped": "skipped"}.get(outcome, ""))
        message = (child.get("message") or "").strip().splitlines() if child is not None else []
        found[test] = {"outcome": outcome, "message": message[0][:300] if message else ""}
    return found


def compare(by_mode: dict[str, dict[str, dict[str, str]]]) -> list[dict[str, str]]:
    """Every (mode, test) whose outcome is not ``off``'s, with whether it is a known finding."""
    ref = by_mode["off"]
    diffs = []
    for mode, got in by_mode.items():
        for test in sorted(ref.keys() | got.keys()):
            was, now = ref.get(test, {}), got.get(test, {})
            if was.get("outcome") != now.get("outcome"):
                diffs.append({"mode": mode, "test": test,
                              "off": was.get("outcome", "absent"),
                              "outcome": now.get("outcome", "absent"),
                              "message": now.get("message", ""),
                              "known": test in KNOWN_FINDINGS})
    return diffs


def verdict(by_mode: dict[str, dict[str, dict[str, str]]], diffs: list[dict[str, str]]
            ) -> list[str]:
    """What is wrong with a run, as lines (none: the sanitizer agrees with PyTorch's tests)."""
    problems = [f"{d['mode']}: {d['test']}: {d['outcome']} (off: {d['off']}): {d['message']}"
                for d in diffs if not d["known"]]
    # a suite that did not run (a missing test dependency, a collection error) agrees with
    # itself in every mode: no passed test is no verdict
    problems += [f"{mode}: no test passed ({len(got)} collected): the suite did not run"
                 for mode, got in by_mode.items()
                 if not any(o["outcome"] == "passed" for o in got.values())]
    if "all" in by_mode:
        for test in KNOWN_FINDINGS:
            got = by_mode["all"].get(test)
            if got is None:
                continue  # not in this checkout (another torch version)
            if got["outcome"] != "failed" or SANITIZER_ERROR not in got["message"]:
                problems.append(f"all: {test}: {got['outcome']} ({got['message']!r}); the "
                                f"sanitizer should have raised {SANITIZER_ERROR}")
    return problems


def run_mode(root: Path, mode: str, timeout: float, slow: bool = False
             ) -> tuple[int, dict[str, dict[str, str]], str]:
    """One child pytest over ``TESTS`` of the checkout ``root`` in ``mode``: (exit status,
    outcomes, log)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("PYTORCH_TEST_WITH_SLOW", None)
    if slow:
        env["PYTORCH_TEST_WITH_SLOW"] = "1"
    # the flag comes from stackfix's pytest11 entry point (an installed stackfix)
    argv = [sys.executable, "-m", "pytest", *TESTS, "-k", SELECT, *mode_flags(mode),
            "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--tb=line", f"--rootdir={root}",
            "-o", "junit_family=xunit1"]
    ini = root / "pytest.ini"  # the checkout's own configuration, not any ini above it
    argv += ["-c", str(ini) if ini.is_file() else os.devnull]
    code, report, log = run_with_report(argv, root, env, timeout)
    return code, outcomes(report) if report is not None else {}, log


def table(by_mode: dict[str, dict[str, dict[str, str]]], diffs: list[dict[str, str]]) -> str:
    """The per-mode counts, as a markdown table."""
    rows = ["| mode | tests | passed | failed | error | skipped | differ from off |",
            "|---|---|---|---|---|---|---|"]
    for mode, got in by_mode.items():
        n = Counter(t["outcome"] for t in got.values())
        differ = [d for d in diffs if d["mode"] == mode]
        known = sum(d["known"] for d in differ)
        rows.append(f"| {mode} | {len(got)} | {n['passed']} | {n['failed']} | {n['error']} | "
                    f"{n['skipped']} | {len(differ)}"
                    + (f" ({known} known finding)" if known else "") + " |")
    return "\n".join(rows)


def version_counter_finding(seed: int = 1234) -> dict:
    """The known finding by itself: the pattern of ``test_version_counter``'s second half
    (selective checkpointing saves ``sin``'s output, the region mutates it with ``mul_``,
    ``allow_cache_entry_mutation=True``), on the input that test draws (PyTorch's TestCase
    seeds 1234; the test's first half draws one ``randn(3)`` before). Returns the gradient
    with the checkpoint and without, and what ``recompute_sanitizer()`` raises when the region
    runs twice at one call site (the second run locates the first op that differs)."""
    import functools

    import torch
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from fixes.sanitize import RecomputeMismatchError, recompute_sanitizer

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.sin.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def fn(x):
        return x.sin().mul_(2).cos().exp()

    def checkpointed(x):
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy,
                                       allow_cache_entry_mutation=True)
        return checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)

    torch.manual_seed(seed)
    torch.randn(3)  # the test's first input
    x = torch.randn(3, requires_grad=True)
    (got,) = torch.autograd.grad(checkpointed(x).sum(), x)
    (want,) = torch.autograd.grad(fn(x).sum(), x)
    error = None
    try:
        with recompute_sanitizer():
            for _ in range(2):
                checkpointed(x).sum().backward()
    except RecomputeMismatchError as exc:
        error = exc
    return {"input": x.tolist(), "grad_checkpointed": got.tolist(), "grad_reference": want.tolist(),
            "max_abs_error": (got - want).abs().max().item(),
            "sanitizer": None if error is None else {
                "what": str(error.what), "op": error.op, "position": error.position,
                "forward_site": list(error.forward_site),
                "recompute_site": list(error.recompute_site), "message": str(error)}}


def fetch(dest: Path, commit: str | None) -> int:
    """A sparse, shallow checkout of ``SPARSE`` at ``commit`` (default: the installed torch's)."""
    if commit is None:
        import torch

        commit = torch.version.git_version
    url = "https://github.com/pytorch/pytorch"
    steps = [["git", "init", "-q", str(dest)],
             ["git", "-C", str(dest), "remote", "add", "origin", url],
             ["git", "-C", str(dest), "sparse-checkout", "set", "--no-cone", *SPARSE],
             ["git", "-C", str(dest), "fetch", "-q", "--depth", "1", "--filter=blob:none",
              "origin", commit],
             ["git", "-C", str(dest), "checkout", "-q", "FETCH_HEAD"]]
    for step in steps:
        print("+", " ".join(step), flush=True)
        if subprocess.run(step).returncode:
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["finding"]:
        found = version_counter_finding()
        text = json.dumps(found, indent=1)
        if argv[1:2] == ["--out"] and len(argv) == 3:
            Path(argv[2]).write_text(text)
        print(text)
        return 0 if found["sanitizer"] is not None else 1
    if argv[:1] == ["fetch"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.peer_suites fetch",
                                    description=fetch.__doc__)
        p.add_argument("dest", type=Path)
        p.add_argument("--commit", help="a pytorch/pytorch commit or tag")
        args = p.parse_args(argv[1:])
        return fetch(args.dest, args.commit)
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_suites",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--pytorch-tests", required=True, type=Path,
                   help="a PyTorch checkout's root (it holds test/test_autograd.py)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES)} (off is always run)")
    p.add_argument("--slow", action="store_true",
                   help="PyTorch's @slowTest tests too (PYTORCH_TEST_WITH_SLOW=1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child pytest")
    p.add_argument("--out", type=Path, help="write outcomes and differences here (JSON)")
    args = p.parse_args(argv)
    modes = comma_choices(p, args.modes, MODES, "off", "mode(s)")
    root = args.pytorch_tests.resolve()
    missing = [t.split("::")[0] for t in TESTS if not (root / t.split("::")[0]).is_file()]
    if missing:
        p.error(f"not in {root}: {', '.join(missing)}")
    by_mode, codes, tails = {}, {}, {}
    for mode in modes:
        codes[mode], by_mode[mode], log = run_mode(root, mode, args.timeout, args.slow)
        tails[mode] = log[-3000:]
        print(f"{mode:>8}: exit {codes[mode]}, " + ", ".join(
            f"{n} {o}" for o, n in sorted(Counter(
                t["outcome"] for t in by_mode[mode].values()).items())), flush=True)
    unfinished = [m for m in modes if codes[m] not in (0, 1) or not by_mode[m]]
    for mode in unfinished:
        print(f"{mode}: the run did not finish its tests; its log ends:\n{tails[mode]}")
    diffs = compare(by_mode)
    problems = verdict(by_mode, diffs)
    print(table(by_mode, diffs))
    for d in diffs:
        why = KNOWN_FINDINGS[d["test"]] if d["known"] else "UNEXPECTED"
        print(f"{d['mode']}: {d['test']}: {d['outcome']} (off: {d['off']}) -- {why}\n"
              f"    {d['message']}")
    print("\n".join(problems) if problems else
          "every test has off's outcome in every mode, but the known findings, which the "
          "sanitizer names")
    if args.out:
        import torch

        args.out.write_text(json.dumps({
            "torch": torch.__version__, "torch_git_version": torch.version.git_version,
            "tests": list(TESTS), "select": SELECT, "slow": args.slow,
            "manifest": _manifest(root), "exit": codes, "outcomes": by_mode,
            "differences": diffs, "problems": problems, "log_tails": tails}, indent=1))
    return 1 if problems or unfinished else 0


def _manifest(root: Path) -> object:
    # where the checkout's files come from, when it says (MANIFEST.json beside them)
    path = root / "MANIFEST.json"
    return json.loads(path.read_text()) if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
