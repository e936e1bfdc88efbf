"""fixes.testing: the public helpers (and pytest fixtures) for running megatron-core's checkpoint
and fixes.megatron's reclaim in one's own CPU tests. Each scenario runs as a user's test file in
an inner pytest (a child process), found through the installed ``stackfix-testing`` plugin, in
a session that cannot import the harness (``repro``): what a training environment has."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu
pytest_plugins = ("pytester",)
PLUGIN = "fixes.testing.pytest_plugin"

_USER_TESTS = '''
import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as mrandom

ORIGINAL_RNG_GET = mrandom._get_cuda_rng_state
ORIGINAL_BACKWARD = mrandom.CheckpointFunction.backward


def _step(lin, x):
    tensor_parallel.checkpoint(lin, False, x).sum().backward()
    return x.grad


def test_checkpoint_without_the_helper_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: megatron's RNG bookkeeping works as shipped")
    with pytest.raises((RuntimeError, AssertionError), match="Torch not compiled with CUDA"):
        _step(torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True))


def test_reclaim_acts_on_cpu(megatron_recompute_reclaim):
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    reference = torch.autograd.grad(lin(x).sum(), x)[0]
    assert mrandom.CheckpointFunction.backward is not ORIGINAL_BACKWARD  # the reclaim is in
    assert torch.equal(_step(lin, x), reference)
    assert [(e.role, e.action) for e in megatron_recompute_reclaim] == [("input", "released")]


def test_megatron_cpu_yields_tensor_parallel(megatron_cpu):
    assert megatron_cpu is tensor_parallel
    _step(torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True))


def test_originals_are_back_after_the_fixtures():
    assert mrandom._get_cuda_rng_state is ORIGINAL_RNG_GET
    assert mrandom.CheckpointFunction.backward is ORIGINAL_BACKWARD
'''


def _plugin_args() -> list[str]:
    """Where stackfix is installed the entry point loads the plugin; from a source tree on
    PYTHONPATH only (a GPU runner's offline set-up), it is named."""
    installed = any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", PLUGIN]


def test_fixtures_run_megatron_checkpoint_and_the_reclaim_on_cpu(pytester):
    # Nothing heavy is imported here: pytester drops the modules a test imports afterwards, and
    # torch.distributed cannot be imported twice in one process.
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    pytester.makepyfile(test_user=_USER_TESTS)
    # The harness is not installed with the fixes: nothing the helpers run may import it.
    pytester.makeconftest("import sys\n\nsys.modules['repro'] = None  # import repro: ImportError\n")
    result = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", "-q", "-rs")
    outcomes = result.parseoutcomes()
    # With CUDA present the no-helper case skips (nothing to shim); every other test passes.
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4, outcomes
    assert outcomes.get("passed", 0) >= 3 and not {"failed", "errors"} & set(outcomes), outcomes


def test_megatron_and_torch_jits_known_warnings_are_not_a_users(pytester):
    # A user's session shows none of megatron-core's import-time warnings on a machine without
    # Transformer Engine / Apex, nor torch.jit's script_method deprecation its modules trigger
    # (the plugin files them ahead of the project's own filters); a warning of the user's own
    # code still shows.
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    pytester.makepyfile(test_user="""
import warnings

from megatron.core import tensor_parallel  # noqa: F401  (at collection, as users import it)


def test_uses_megatron(megatron_cpu):
    warnings.warn("the user's own")
""")
    result = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1, warnings=1)
    assert "the user's own" in result.stdout.str()


def test_loading_the_plugin_imports_no_torch():
    code = (f"import sys, {PLUGIN}, fixes.testing; "
            "print([m for m in ('torch', 'megatron', 'repro') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


# A user's test marked as the README's examples are.
_MARKED = """
import pytest


@pytest.mark.cpu
def test_on_cpu():
    pass


@pytest.mark.gpu
def test_on_gpu():
    pass
"""
_STRICT = ("-p", "no:cacheprovider", "-q", "--strict-markers",
           "-W", "error::pytest.PytestUnknownMarkWarning")


def test_the_cpu_and_gpu_markers_are_registered_for_users(pytester):
    pytester.makepyfile(test_user=_MARKED)
    result = pytester.runpytest_subprocess(*_plugin_args(), *_STRICT)
    result.assert_outcomes(passed=2)
    markers = pytester.runpytest_subprocess(*_plugin_args(), "--markers").stdout.str()
    assert "@pytest.mark.cpu: runs on any machine (CPU only)" in markers
    assert "@pytest.mark.gpu: needs CUDA" in markers


def test_a_projects_own_declaration_of_the_markers_is_kept(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    cpu: our own meaning of cpu\n")
    pytester.makepyfile(test_user=_MARKED)
    result = pytester.runpytest_subprocess(*_plugin_args(), *_STRICT)
    result.assert_outcomes(passed=2)
    markers = pytester.runpytest_subprocess(*_plugin_args(), "--markers").stdout.str()
    assert "@pytest.mark.cpu: our own meaning of cpu" in markers
    assert markers.count("@pytest.mark.cpu:") == 1 and "@pytest.mark.gpu: needs CUDA" in markers


def test_an_installed_megatron_that_fails_to_import_is_an_error_not_a_skip(pytester):
    # Before: the fixture's importorskip turned a broken megatron-core into a skip of every test
    # that used it, in users' suites as in ours.
    pytester.mkpydir("megatron")
    pytester.mkpydir("megatron/core")
    # what a broken install looks like: one of its dependencies is missing
    pytester.path.joinpath("megatron", "core", "__init__.py").write_text(
        "import stackfix_no_such_megatron_dependency\n")
    pytester.makepyfile(test_user="def test_uses_megatron(megatron_cpu):\n    pass\n")
    result = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(errors=1)
    assert "No module named 'stackfix_no_such_megatron_dependency'" in result.stdout.str()
