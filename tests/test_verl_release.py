"""repro.verl_release: a leaf of a verl release runs as released, its package ``__init__``\\ s do
not, and one release per process. Each case runs in a child interpreter (the loader is per
process). A fake release (``__init__``\\ s that raise) checks the mechanism without verl; the
real releases are checked where ``python -m repro.verl_release install`` put them."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from repro import run_isolated
from repro.verl_release import (
    ENV_ROOT,
    RELEASES,
    VerlUnavailable,
    main,
    missing_release,
    release_dir,
)

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
    why = missing_release(version)
    if why is not None:
        pytest.skip(why)
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


@pytest.fixture
def function_root(tmp_path):
    """Release 9.9.9 whose module cannot be imported (its top level raises) but whose functions
    can be compiled one at a time."""
    rel = tmp_path / "9.9.9"
    (rel / "verl-9.9.9.dist-info").mkdir(parents=True)
    (rel / "verl/x").mkdir(parents=True)
    (rel / "verl/__init__.py").write_text("")
    (rel / "verl/x/mod.py").write_text(textwrap.dedent("""\
        from __future__ import annotations
        raise ImportError("module top level ran")

        class Engine(Base):
            def scale(self, x: NotImported) -> NotImported:
                return FACTOR * x + self.offset

            def helper(self):
                return super().helper()

        def boom():
            raise ValueError("released line")
        """))
    return tmp_path


def test_released_function_runs_one_def_and_nothing_else(function_root, monkeypatch):
    monkeypatch.setenv(ENV_ROOT, str(function_root))
    from types import SimpleNamespace

    from repro.verl_release import released_function

    scale = released_function("9.9.9", "verl.x.mod", "Engine.scale", {"FACTOR": 3})
    assert scale(SimpleNamespace(offset=1), 2) == 7  # the module's raise never ran
    assert scale.__code__.co_filename == str(function_root / "9.9.9/verl/x/mod.py")
    assert scale.__code__.co_firstlineno == 5  # tracebacks name the released line
    assert scale.__annotations__ == {"x": "NotImported", "return": "NotImported"}  # file's future
    boom = released_function("9.9.9", "verl.x.mod", "boom", {})
    with pytest.raises(ValueError, match="released line") as e:
        boom()
    assert e.traceback[-1].lineno + 1 == 12


def test_released_function_names_what_it_cannot_do(function_root, monkeypatch):
    monkeypatch.setenv(ENV_ROOT, str(function_root))
    from repro.verl_release import released_function

    with pytest.raises(ValueError, match=r"reads globals \['FACTOR'\]"):
        released_function("9.9.9", "verl.x.mod", "Engine.scale", {})
    with pytest.raises(ValueError, match="uses super"):
        released_function("9.9.9", "verl.x.mod", "Engine.helper", {})
    with pytest.raises(LookupError, match="has no function Engine.nope"):
        released_function("9.9.9", "verl.x.mod", "Engine.nope", {})
    with pytest.raises(LookupError, match="has no module verl.x.other"):
        released_function("9.9.9", "verl.x.other", "f", {})
    with pytest.raises(VerlUnavailable):
        released_function("0.0.1", "verl.x.mod", "boom", {})


def test_install_refuses_a_release_it_does_not_compare_naming_those_it_does(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["install", "--root", str(tmp_path), "0.7.9"])
    assert exit_.value.code == 2
    assert "error: verl 0.7.9 is not one of the releases the repros compare: 0.8.0, 0.9.1" in (
        capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_a_failed_pip_install_is_one_error_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    def failing_pip(cmd):
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(subprocess, "run", failing_pip)
    assert main(["install", "--root", str(tmp_path), "0.9.1"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"error: pip could not install verl==0.9.1 into {tmp_path / '0.9.1'} (exit status 1; "
        f"its output above)")
