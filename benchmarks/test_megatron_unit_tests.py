"""benchmarks.megatron_unit_tests: a checkout's tests run once per reclaim, outcomes compared.

Megatron-LM's own unit tests need CUDA; here a stand-in checkout (a ``tests/unit_tests`` tree
written by the test) exercises the runner on CPU: its plugin installs the reclaim it is asked
for in every child session, equal outcomes (failures and skips included) pass, a changed one
fails naming the test, and bad input is refused."""

from __future__ import annotations

import json
import textwrap

import pytest

from benchmarks import megatron_unit_tests as mut

pytestmark = pytest.mark.cpu

_TESTS = '''
import pytest


def test_the_session_has_the_reclaim_it_was_asked_for(request):
    from fixes.megatron.reclaim import PATCH_KIND, installed_reclaim

    asked = request.config.getoption("--stackfix-reclaim")
    assert installed_reclaim() == {"none": None, "ours": PATCH_KIND}[asked]


def test_fails_with_any_reclaim():
    assert False


@pytest.mark.skip(reason="the environment")
def test_skipped_with_any_reclaim():
    pass
'''


def _checkout(tmp_path, extra: str = ""):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    unit = tmp_path / "tests" / "unit_tests"
    unit.mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (unit / "__init__.py").write_text("")
    (unit / "test_stand_in.py").write_text(_TESTS + textwrap.dedent(extra))
    return tmp_path


def test_only_an_outcome_that_depends_on_the_reclaim_is_a_difference(tmp_path, capsys):
    """Two child sessions (none, ours): the same failure and skip in both are no difference;
    the one test whose outcome changes with the reclaim is named, and the run fails."""
    root = _checkout(tmp_path, '''

        def test_passes_without_a_reclaim_only():
            from fixes.megatron.reclaim import installed_reclaim

            assert installed_reclaim() is None
    ''')
    out = tmp_path / "out.json"
    assert mut.main(["--tests", str(root), "--files", "tests/unit_tests/test_stand_in.py",
                     "--reclaims", "ours", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "none: exit 1, 1 failed, 2 passed, 1 skipped" in printed
    assert "ours: exit 1, 2 failed, 1 passed, 1 skipped" in printed
    assert json.loads(out.read_text())["differences"] == [
        "ours: tests.unit_tests.test_stand_in::test_passes_without_a_reclaim_only: failed "
        "(with none: passed)"]


def test_bad_input_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mut.main(["--tests", str(tmp_path), "--reclaims", "ours,alias-aware"])
    assert exit_info.value.code == 2
    assert "unknown reclaim(s) alias-aware; allowed: none, ours" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mut.main(["--tests", str(tmp_path), "--files", "tests/nope.py"])
    assert "not in" in capsys.readouterr().err


def test_outcomes_are_read_per_test_from_the_junit_report():
    report = """<testsuites><testsuite>
        <testcase classname="a" name="t1"/>
        <testcase classname="a" name="t2"><failure message="x"/></testcase>
        <testcase classname="a" name="t3"><skipped message="env"/></testcase>
        <testcase classname="a" name="t4"><error message="setup"/></testcase>
    </testsuite></testsuites>"""
    assert mut.outcomes(report) == {"a::t1": "passed", "a::t2": "failed", "a::t3": "skipped",
                                    "a::t4": "error"}
