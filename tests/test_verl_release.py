"""repro.verl_release: a leaf of a verl release runs as released, its package ``__init__``\\ s do
not, and one release per process. Each case runs in a child interpreter (the loader is per
process). A fake release (``__init__``\\ s that raise) checks the mechanism without verl; the
real releases are checked where ``python -m repro.verl_release install`` put them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from repro import run_isolated
from repro.verl_release import ENV_ROOT, RELEASES, VerlUnavailable, release_dir

pytestmark = pytest.mark.cpu
REPO = str(Path(__file__).parent.parent)


def _child(code: str, root) -> object:
    return run_isolated(code=textwrap.dedent(code), timeout=120, cwd=REPO,
                        env={ENV_ROOT: str(root)})


@pytest.fixture
def fake_root(tmp_path):
    """Release 9.9.9: every package __init__ raises; leaf a/leaf.py imports leaf b/other.py."""
    rel = tmp_path / "9.9.9"
    (rel / "verl-9.9.9.dist-info").mkdir(parents=True)
    for pkg in ("verl", "verl/a", "verl/b"):
        (rel / pkg).mkdir(exist_ok=True)
        (rel / pkg / "__init__.py").write_text("raise RuntimeError('package __init__ ran')\n")
    (rel / "verl/a/leaf.py").write_text("from verl.b.other import VALUE\nDOUBLE = 2 * VALUE\n")
    (rel / "verl/b/other.py").write_text("VALUE = 21\n")
    return tmp_path


def test_leaf_runs_as_released_without_package_inits(fake_root):
    r = _child(f"""
        import sys
        from repro.verl_release import import_verl, loaded_version
        leaf = import_verl("9.9.9", "verl.a.leaf")
        assert leaf.DOUBLE == 42
        assert leaf.__file__ == {str(fake_root / "9.9.9/verl/a/leaf.py")!r}
        assert sys.modules["verl.b.other"].__file__.startswith({str(fake_root)!r})
        assert sys.modules["verl"].__path__ == [{str(fake_root / "9.9.9/verl")!r}]
        assert loaded_version() == "9.9.9"
        print("LOADER-OK")
    """, fake_root)
    assert r.ok and "LOADER-OK" in r.stdout, r.stderr[-3000:]


def test_second_version_in_one_process_is_refused(fake_root):
    r = _child("""
        from repro.verl_release import VerlVersionConflict, import_verl
        import_verl("9.9.9", "verl.b.other")
        try:
            import_verl("0.9.1", "verl.b.other")
        except VerlVersionConflict as e:
            print("REFUSED", e)
    """, fake_root)
    assert r.ok and "REFUSED this process already imports verl 9.9.9" in r.stdout, r.stderr[-3000:]


def test_missing_release_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ROOT, str(tmp_path))
    from repro import Skipped
    from repro.verl_release import require_release  # no import state touched

    with pytest.raises(VerlUnavailable, match="python -m repro.verl_release install --root") as e:
        require_release("0.9.1")
    assert isinstance(e.value, Skipped) and isinstance(e.value, ImportError)


@pytest.mark.parametrize("version", RELEASES)
def test_real_release_patch_module_imports_without_verl_dependencies(version):
    if not (release_dir(version) / f"verl-{version}.dist-info").is_dir():
        pytest.skip(f"verl {version} not installed under {release_dir(version).parent} "
                    f"(python -m repro.verl_release install)")
    r = _child(f"""
        import sys
        from repro.verl_release import import_verl
        patch = import_verl({version!r}, "verl.models.mcore.patch")
        assert callable(patch.apply_patch_megatron_recomputation_backward)
        heavy = [m for m in ("ray", "hydra", "transformers", "tensordict") if m in sys.modules]
        assert not heavy, heavy
        print("REAL-OK", patch.__file__)
    """, release_dir(version).parent)
    assert r.ok and f"REAL-OK {release_dir(version)}" in r.stdout, r.stderr[-3000:]
