"""README.md's recipe for a user's own regression test is run as one: the code block between
its ``recipe`` markers, as a test file of an inner pytest that finds stackfix's pytest plugin as
a user's does, under ``--strict-markers`` and under each ``--stackfix-sanitize`` value the
README documents (the recipe enters ``storage_sanitizer()`` itself, inside the plugin's). A
README whose example no longer passes fails here."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import tempfile
from pathlib import Path

import pytest

from repro import run_isolated

pytestmark = pytest.mark.cpu
pytest_plugins = ("pytester",)
README = Path(__file__).parent.parent / "README.md"
PLUGINS = ("fixes.testing.pytest_plugin", "fixes.sanitize.pytest_plugin")
# No flag and every sanitizer here; the bare flag and recompute's cheaper modes (about 4 s a
# session) run with the deep tests (pytest -m deep, tox -e deep).
FLAGS = ((), ("--stackfix-sanitize=storage,mesh,recompute",), *[
    pytest.param(flag, marks=pytest.mark.deep)
    for flag in (("--stackfix-sanitize",), ("--stackfix-sanitize=storage,mesh,recompute:sampled",),
                 ("--stackfix-sanitize=storage,mesh,recompute:none",))])


def recipe() -> str:
    text = README.read_text()
    block = re.search(r"<!-- recipe:begin[^>]*-->\s*```python\n(.*?)```\s*<!-- recipe:end -->",
                      text, re.S)
    assert block, "README.md has no recipe block between <!-- recipe:begin --> and :end"
    return block[1]


def _plugin_args() -> list[str]:
    """Where stackfix is installed, pytest loads its plugins through the entry points."""
    installed = {ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    return [arg for p in PLUGINS if p not in installed for arg in ("-p", p)]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f[0].split("=")[-1] if f else "no-flag")
def test_the_readmes_recipe_passes_as_a_users_test_file(pytester, flags):
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    pytester.makepyfile(test_recipe=recipe())
    pythonpath = os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH"),
                                               str(README.parent)]))
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    r = run_isolated(module="pytest", args=[f"--basetemp={basetemp}", *_plugin_args(),
                                            "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                                            "-W", "error::pytest.PytestUnknownMarkWarning",
                                            "--strict-markers", *flags],
                     cwd=str(pytester.path), env={"PYTHONPATH": pythonpath}, timeout=300,
                     forkserver=True)
    result = pytest.RunResult(r.returncode, r.stdout.splitlines(), r.stderr.splitlines(),
                              r.seconds)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    result.assert_outcomes(passed=2)


def runnable_blocks() -> list[str]:
    return re.findall(r"<!-- runnable:begin[^>]*-->\s*```python\n(.*?)```\s*<!-- runnable:end -->",
                      README.read_text(), re.S)


def test_the_readmes_runnable_snippets_run_as_written():
    """A snippet a user copies (``runnable`` markers: self-contained, CPU) runs as written, in
    a child (a newcomer's pass found ``context_fn=mesh_preserving_context_fn()``, a call where
    the function itself belongs: ``TypeError: 'tuple' object is not callable``)."""
    blocks = runnable_blocks()
    assert blocks, "README.md has no block between <!-- runnable:begin --> and :end"
    for block in blocks:
        r = run_isolated(code=block, cwd=str(README.parent), timeout=300, forkserver=True)
        assert r.returncode == 0, block + r.stdout[-2000:] + r.stderr[-3000:]

