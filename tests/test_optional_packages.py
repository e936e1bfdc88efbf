"""One contract for every optional upstream (torchtitan, torch_remat, megatron-core, vLLM): with the package
absent, ``import fixes.<stack>`` still works, exposes its public names and never imports it,
and the CPU suite collects with skips, never an ImportError."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro import run_isolated

pytestmark = pytest.mark.cpu

ROOT = str(Path(__file__).parent.parent)
OPTIONAL = ("torchtitan", "torch_remat", "megatron", "vllm")

# Setting sys.modules[name] = None makes every `import name...` raise ImportError, as if absent.
# The children are forked from the "spmd" fork server: it preloads none of OPTIONAL (the
# "torch" one preloads megatron-core), so each starts as a fresh interpreter without them would.
BLOCK = (f"import sys\nassert not {{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r})\n"
         f"for _m in {OPTIONAL!r}:\n    sys.modules[_m] = None\n")

PUBLIC = {
    "fixes.torchtitan": ("mesh_preserving_context_fn", "mesh_preserving", "single_threaded_backward",
                         "make_checkpoint_wrappers_mesh_preserving", "TorchtitanEngineConfig",
                         "TorchtitanEngine", "derive_name_and_flavor",
                         "mesh_preserving_remat_checkpoint", "MeshRecomputeStateHook"),
    "fixes.megatron": ("is_storage_exclusive", "apply_recompute_reclaim_patch",
                       "remove_recompute_reclaim_patch", "apply_mtp_postprocess_patch",
                       "remove_mtp_postprocess_patch"),
    "fixes.vllm": ("mtp_completeness_check_disabled", "moe_layer_classes", "load_refit_weights"),
    "fixes.sanitize": ("storage_sanitizer", "mesh_sanitizer", "ReleasedStorageError",
                       "MeshLostError"),
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_fixes_import_without_the_optional_packages(package):
    names = PUBLIC[package]
    code = BLOCK + (
        f"import {package} as f\n"
        f"missing = [n for n in {names!r} if not callable(getattr(f, n, None))]\n"
        "assert not missing, missing\n"
        f"loaded = [m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r} and sys.modules[m]]\n"
        "assert not loaded, loaded\n"
    )
    result = run_isolated(code=code, timeout=120, cwd=ROOT, forkserver="spmd")
    assert result.ok, result.stderr[-3000:]


def test_fused_moe_is_none_without_vllm():
    result = run_isolated(code=BLOCK + "import fixes.vllm as f\nassert f.FusedMoE is None\n",
                          timeout=120, cwd=ROOT, forkserver="spmd")
    assert result.ok, result.stderr[-3000:]


def test_cpu_suite_collects_without_the_optional_packages():
    code = BLOCK + (
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-m', 'cpu', '-p', 'no:cacheprovider',"
        " '-p', 'no:xdist', 'tests']))\n"
    )
    result = run_isolated(code=code, timeout=300, cwd=ROOT, forkserver="spmd")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error" not in result.stdout.lower().split("collected")[-1], result.stdout[-3000:]
