"""``benchmarks.peer_suites``: PyTorch's own checkpoint tests agree with and without the recompute
sanitizer. The runner's verdict is checked in-process on made-up reports (milliseconds); the
known finding (``test_version_counter``'s recompute really is wrong) by itself; the whole
comparison against a PyTorch checkout (``STACKFIX_PYTORCH_TESTS``) is deep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peer_suites as peer

pytestmark = pytest.mark.cpu

FINDING = next(iter(peer.KNOWN_FINDINGS))
_REPORT = """<testsuites><testsuite>
<testcase classname="test.test_autograd.TestNestedCheckpoint" name="test_a"/>
<testcase classname="test.test_autograd.TestSelectiveActivationCheckpoint"
          name="test_version_counter">{finding}</testcase>
<testcase classname="test.test_utils.TestCheckpoint" name="test_b">{b}</testcase>
<testcase classname="test.test_utils.TestCheckpoint" name="test_gpu">
  <skipped message="No accelerator"/></testcase>
</testsuite></testsuites>"""
_OURS = '<failure message="fixes.sanitize._errors.RecomputeMismatchError: recompute of ..."/>'


def _outcomes(finding: str = "", b: str = "") -> dict:
    return peer.outcomes(_REPORT.format(finding=finding, b=b))


def test_a_report_gives_each_test_its_outcome_and_first_line():
    got = _outcomes(b='<error message="boom&#10;more"/>')
    assert got["test/test_autograd.py::TestNestedCheckpoint::test_a"] == {
        "outcome": "passed", "message": ""}
    assert got["test/test_utils.py::TestCheckpoint::test_b"] == {
        "outcome": "error", "message": "boom"}
    assert got["test/test_utils.py::TestCheckpoint::test_gpu"]["outcome"] == "skipped"
    assert FINDING in got


def test_only_the_known_finding_may_differ_and_the_sanitizer_must_name_it():
    off = _outcomes()
    named = {"off": off, "all": _outcomes(finding=_OURS)}
    assert [d["known"] for d in peer.compare(named)] == [True]
    assert peer.verdict(named, peer.compare(named)) == []

    # another test's outcome changed: a defect, named
    other = {"off": off, "all": _outcomes(finding=_OURS, b='<failure message="x"/>')}
    problems = peer.verdict(other, peer.compare(other))
    assert len(problems) == 1 and "TestCheckpoint::test_b: failed (off: passed)" in problems[0]

    # the finding not caught in all, or failing for another reason: a defect too
    for got in ("", '<failure message="AssertionError"/>'):
        missed = {"off": off, "all": _outcomes(finding=got)}
        assert "should have raised RecomputeMismatchError" in " ".join(
            peer.verdict(missed, peer.compare(missed)))
    # sampled / none may miss it
    assert peer.verdict({"off": off, "none": off}, []) == []
    # a suite that did not run (every mode one collection error) is no agreement
    broken = {"test/test_utils.py::::test_utils": {"outcome": "error", "message": "expecttest"}}
    assert [p.split(":")[0] for p in peer.verdict({"off": broken, "all": broken}, [])] == [
        "off", "all"]


def test_the_modes_are_the_plugins_flag():
    assert [peer.mode_flags(m) for m in peer.MODES] == [
        [], ["--stackfix-sanitize=recompute"], ["--stackfix-sanitize=recompute:sampled"],
        ["--stackfix-sanitize=recompute:none"]]
    with pytest.raises(ValueError, match="unknown mode"):
        peer.mode_flags("fast")


@pytest.mark.no_stackfix_sanitize
def test_the_known_finding_is_a_wrong_gradient_the_sanitizer_locates():
    """test_version_counter's pattern on its input: with ``allow_cache_entry_mutation=True``
    the recompute's ``sin`` is the cached, already doubled value and ``mul_`` doubles it again,
    so the saved tensor backward uses differs and the gradient is wrong; values="all" names
    ``sin`` (op #0), its cache entry, on the region's next run."""
    found = peer.version_counter_finding()
    assert found["max_abs_error"] > 0.1, found
    ours = found["sanitizer"]
    assert ours is not None and (ours["what"], ours["op"], ours["position"]) == (
        "values", "aten.sin.default", 0), ours
    assert "saved after op #1 aten.mul_.Tensor" in ours["message"]


@pytest.mark.deep
@pytest.mark.no_stackfix_sanitize
def test_pytorchs_checkpoint_tests_agree_with_the_sanitizer(tmp_path):
    """Every mode (off, all, sampled, none) over a PyTorch checkout's checkpoint tests: no
    outcome but the known finding's differs from off's, and all names the finding."""
    root = os.environ.get("STACKFIX_PYTORCH_TESTS")
    if not root:
        pytest.skip("STACKFIX_PYTORCH_TESTS is not set (a PyTorch checkout's root: "
                    "python -m benchmarks.peer_suites fetch DIR)")
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.peer_suites", "--pytorch-tests",
                           root, "--out", str(out)], capture_output=True, text=True,
                          cwd=Path(peer.__file__).resolve().parent.parent, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["problems"] == []
    assert len(results["outcomes"]["off"]) >= 50  # the tests ran
    if FINDING in results["outcomes"]["all"]:
        assert any(d["test"] == FINDING and d["mode"] == "all" for d in results["differences"])
