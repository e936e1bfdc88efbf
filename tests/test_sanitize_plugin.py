"""``pytest --stackfix-sanitize``: the plugin is declared as a pytest11 entry point, is off by
default, and with the flag turns a released-storage read and a lost mesh into named test
failures (inner pytest sessions in subprocesses, so the outer session's own sanitizers, if any,
are not nested)."""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
import tomllib
from pathlib import Path

import pytest

from repro import run_isolated

pytest_plugins = ("pytester",)
pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "fixes.sanitize.pytest_plugin"

INNER_TESTS = '''
import pytest
import spmd_types as spmd
import torch
from torch.utils.checkpoint import checkpoint


def test_sanitizers_are_on():
    assert "resize_" in torch.UntypedStorage.__dict__
    assert getattr(spmd.current_mesh, "__stackfix_mesh_sanitizer_wraps__", None) is not None


def test_released_storage_read():
    h = torch.randn(4, 8)
    a, b = torch.chunk(h, 2, -1)
    a.untyped_storage().resize_(0)
    b.sum()


def test_mesh_lost_in_recompute():
    from repro.harness.spmd_mesh import spmd_mesh

    x = torch.randn(4, requires_grad=True)
    with spmd.set_current_mesh(spmd_mesh()):
        loss = checkpoint(lambda t: t.sin() if spmd.current_mesh() is None else t.cos(), x,
                          use_reentrant=False).sum()
    loss.backward()


def test_clean():
    x = torch.randn(4, requires_grad=True)
    (x * 2).sum().backward()


def test_recompute_replays_a_side_effect():
    calls = torch.zeros(())
    x = torch.randn(4, requires_grad=True)
    checkpoint(lambda t: calls.add_(1) + t.sin(), x, use_reentrant=False).sum().backward()


def test_enters_its_own_sanitizer_unmarked():
    from fixes.sanitize import storage_sanitizer

    with storage_sanitizer():  # joins the plugin's
        h = torch.randn(4, 8)
        a, b = torch.chunk(h, 2, -1)
        a.untyped_storage().resize_(0)
        with pytest.raises(Exception, match="would access freed memory"):
            b.sum()


@pytest.mark.no_stackfix_sanitize
def test_enters_its_own_sanitizer():
    from fixes.sanitize import storage_sanitizer

    with storage_sanitizer():  # would refuse to nest inside the plugin's
        pass
'''


def _plugin_args() -> list[str]:
    """Where stackfix is installed, pytest loads the plugin through the entry point already."""
    installed = any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", PLUGIN]


def _run(pytester, *args, tests: str = INNER_TESTS) -> pytest.RunResult:
    """An inner ``python -m pytest`` of ``tests`` (as ``test_inner.py``) in pytester's
    directory, as ``runpytest_subprocess`` runs it (that directory first on PYTHONPATH, its own
    basetemp), forked from the fork server."""
    pytester.makepyfile(test_inner=tests)
    pythonpath = os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")]))
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    r = run_isolated(module="pytest", args=[f"--basetemp={basetemp}", *_plugin_args(),
                                            "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                     cwd=str(pytester.path), env={"PYTHONPATH": pythonpath, "COLUMNS": "160"},
                     timeout=300, forkserver=True)
    return pytest.RunResult(r.returncode, r.stdout.splitlines(), r.stderr.splitlines(), r.seconds)


def test_entry_point_is_declared_in_pyproject():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # stackfix-testing: the users' fixtures (megatron_cpu, megatron_recompute_reclaim).
    assert meta["project"]["entry-points"]["pytest11"] == {
        "stackfix": PLUGIN, "stackfix-testing": "fixes.testing.pytest_plugin"}
    module = pytest.importorskip(PLUGIN)
    assert callable(module.pytest_addoption) and callable(module.pytest_runtest_protocol)


def test_with_the_flag_failures_are_named(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    # The bare flag before a test path: the path is not taken for the flag's value.
    result = _run(pytester, "--stackfix-sanitize", "test_inner.py", "-rA")
    result.assert_outcomes(passed=5, failed=2)
    result.stdout.fnmatch_lines([
        "stackfix sanitizers: storage_sanitizer, mesh_sanitizer",
        "E *.ReleasedStorageError: aten.sum.default at test_inner.py:* in test_released_storage_read"
        " would access freed memory (released at test_inner.py:*)",
        # the deepest frame shown is the test's own line, not torch's
        "test_inner.py:*: ReleasedStorageError",
        "E *.MeshLostError: spmd_types.current_mesh() found no current spmd mesh *",
        "PASSED test_inner.py::test_sanitizers_are_on",
        "PASSED test_inner.py::test_clean",
        # the test's own entry joins the plugin's
        "PASSED test_inner.py::test_enters_its_own_sanitizer_unmarked",
        "PASSED test_inner.py::test_enters_its_own_sanitizer",
        # the short summary keeps what matters: the op, its line and the release site
        "FAILED test_inner.py::test_released_storage_read - ReleasedStorageError: "
        "aten.sum.default at test_inner.py:*, released at test_inner.py:*",
        "FAILED test_inner.py::test_mesh_lost_in_recompute - *",
    ])
    assert "RecomputeMismatchError" not in result.stdout.str()  # not asked for
    released = result.stdout.str().split(" test_released_storage_read _")[1].split("_ test_")[0]
    assert "site-packages/torch/" not in released and "raised in repr()" not in released


def test_a_list_names_the_sanitizers(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = _run(pytester, "--stackfix-sanitize=storage,recompute", "-rA",
                  "-k", "released or side_effect or clean")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "stackfix sanitizers: storage_sanitizer, recompute_sanitizer",
        "E *.ReleasedStorageError: aten.sum.default at test_inner.py:* would access freed memory*",
        "E *.RecomputeMismatchError: recompute of checkpointed region *<lambda> * (side effect)*",
        "FAILED test_inner.py::test_recompute_replays_a_side_effect - *",
    ])
    bad = _run(pytester, "--stackfix-sanitize=storage,nope")
    assert bad.ret != 0 and "is not a comma-separated list of storage, mesh, recompute" in (
        bad.stdout.str() + bad.stderr.str())


def test_the_recompute_sanitizers_values_mode_can_be_named(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = _run(pytester, "--stackfix-sanitize=storage,recompute:sampled", "-rA",
                  "-k", "side_effect or clean")
    result.assert_outcomes(passed=1, failed=1)  # a side effect is caught in every mode
    result.stdout.fnmatch_lines([
        "stackfix sanitizers: storage_sanitizer, recompute_sanitizer (values=sampled)"])
    for bad, says in (("recompute:some", "recompute's mode must be one of all, sampled, none"),
                      ("storage:sampled", "only recompute takes a mode")):
        out = _run(pytester, f"--stackfix-sanitize={bad}")
        assert out.ret != 0 and says in out.stdout.str() + out.stderr.str(), bad


def test_off_by_default(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    # Without the flag the freed read would crash the session: run only the harmless tests.
    result = _run(pytester, "-k", "sanitizers_are_on or clean or own or side_effect")
    # test_sanitizers_are_on fails: nothing wrapped; the side effect goes unnoticed
    result.assert_outcomes(passed=4, failed=1)
    assert "stackfix sanitizers" not in result.stdout.str()
    assert "--stackfix-sanitize" in _run(pytester, "--help").stdout.str()


def test_without_the_flag_a_session_imports_no_torch(tmp_path):
    # The plugin loads in every pytest session of an environment with stackfix installed: a
    # suite that never asks for the sanitizers must not pay for importing torch.
    (tmp_path / "test_light.py").write_text(
        "import sys\n\n\ndef test_light():\n    assert 'torch' not in sys.modules\n")
    r = run_isolated(module="pytest", args=[*_plugin_args(), "-p", "no:cacheprovider",
                                            "-p", "no:xdist", "-q", str(tmp_path)],
                     cwd=str(tmp_path), env={"PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]


# A user's own test: the sanitizer entered in the test, the freed chunk passed to a model whose
# forward(self, x) receives it. Once the error has left the ``with`` block, pytest prints the
# traceback: each frame's arguments (long tracebacks) or locals (-l) -- the released tensor.
USER_TESTS = """
import pytest
import torch
from fixes.sanitize import storage_sanitizer


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.no_stackfix_sanitize
def test_model_reads_a_released_chunk():
    model = Model()
    a, b = torch.randn(4, 16).chunk(2, -1)
    with storage_sanitizer():
        a.untyped_storage().resize_(0)
        model(b)


def test_the_session_goes_on():
    pass
"""


_STYLES = {"default": [], "long": ["--tb=long"], "l": ["-l"],
           "showlocals": ["--showlocals", "--tb=long"], "short": ["--tb=short"],
           "native": ["--tb=native"]}


def _style_params():
    """Every traceback style with and without the flag; those that print frame locals (where a
    released tensor's repr would crash the session) in the fast suite, the rest deep."""
    for flag_id, flag in (("no-flag", []), ("flag", ["--stackfix-sanitize"])):
        for style_id, style in _STYLES.items():
            marks = () if style_id in ("l", "showlocals") else (pytest.mark.deep,)
            yield pytest.param(flag, style, marks=marks, id=f"{style_id}-{flag_id}")


@pytest.mark.parametrize(("flag", "style"), list(_style_params()))
def test_a_released_storage_error_is_a_failure_under_every_traceback_style(pytester, monkeypatch,
                                                                           flag, style):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = _run(pytester, *flag, *style, tests=USER_TESTS)
    out = result.stdout.str()
    assert result.ret == 1, (result.ret, out[-3000:], result.stderr.str()[-3000:])
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "FAILED test_inner.py::test_model_reads_a_released_chunk - ReleasedStorageError: "
        "aten.addmm.default at test_inner.py:*, released at test_inner.py:*",
        "*= 1 failed, 1 passed*",
    ])
    assert "Segmentation fault" not in result.stderr.str()
    if "-l" in style or "--showlocals" in style:  # what the freed chunk's repr now says
        result.stdout.fnmatch_lines(["b * = tensor(<released storage>, size=(4, 8), *"])
