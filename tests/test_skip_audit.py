"""Skips that cannot hide a broken install: an optional package is skipped only when it is
absent or does not import on this stack (``repro.harness.optional``), and every tox env fails a
run in which a test skipped for a reason that env does not allow -- such as a package it
installs (``repro.harness.skip_audit``)."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

from repro import run_isolated
from repro.harness import skip_audit
from repro.harness.optional import OptionalUnavailable, import_optional

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def _broad(handler: ast.ExceptHandler) -> bool:
    names = []
    if handler.type is None:
        return True
    for node in ast.walk(handler.type):
        if isinstance(node, ast.Name):
            names.append(node.id)
    return bool({"Exception", "BaseException"} & set(names))


def test_no_broad_except_around_an_import_in_tests_or_benchmarks():
    found = []
    for path in sorted([*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Try):
                continue
            imports = any(isinstance(n, (ast.Import, ast.ImportFrom))
                          for stmt in node.body for n in ast.walk(stmt))
            if imports and any(_broad(h) for h in node.handlers):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"an import failure other than ImportError would become a skip: {found}"


def test_import_optional_tells_an_absent_package_from_a_broken_one(tmp_path, monkeypatch):
    for name, body in {
        "stackfix_t_broken": "raise RuntimeError('broken at import')\n",
        "stackfix_t_needs_dep": "import stackfix_t_no_such_dependency\n",
        "stackfix_t_old_stack": "from os import stackfix_t_no_such_name\n",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(OptionalUnavailable, match="stackfix_t_absent is not installed"):
        import_optional("stackfix_t_absent.sub")
    with pytest.raises(OptionalUnavailable, match="does not import here: cannot import name"):
        import_optional("stackfix_t_old_stack")
    with pytest.raises(RuntimeError, match="broken at import"):
        import_optional("stackfix_t_broken")  # a broken install is an error, not a skip
    with pytest.raises(ModuleNotFoundError, match="stackfix_t_no_such_dependency"):
        import_optional("stackfix_t_needs_dep")  # so is an installed package's missing dependency
    assert import_optional("json.decoder") is sys.modules["json.decoder"]


def _fake_release(root: Path, name: str, version: str, requires: list[str], body: str) -> None:
    """An installed distribution (dist-info with its Requires-Dist) whose import runs ``body``."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join(meta + [f"Requires-Dist: {r}" for r in requires])
                                   + "\n")


def test_an_import_failure_is_a_version_conflict_only_when_torch_is_older_than_required(
        tmp_path, monkeypatch):
    # The H200 image's torch 2.11 against torchtitan 0.3.0 (needs 2.12): a legitimate skip that
    # names the package, its requirement and the torch found; the same failure on a torch the
    # package accepts is a broken install, and every env's audit refuses its skip.
    body = "from os import stackfix_t_no_such_name\n"
    _fake_release(tmp_path, "stackfix_t_needs_new", "1.0", ["torch>=99.1"], body)
    _fake_release(tmp_path, "stackfix_t_needs_old", "1.0", ["torch>=1.0"], body)
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(OptionalUnavailable) as too_old:
        import_optional("stackfix_t_needs_new")
    with pytest.raises(OptionalUnavailable) as broken:
        import_optional("stackfix_t_needs_old")
    # the installed distribution's version, as the requirement is judged against it (PyPI's
    # CUDA build of torch 2.13.0 says 2.13.0 there, 2.13.0+cu130 in torch.__version__)
    assert str(too_old.value).startswith("stackfix_t_needs_new 1.0 needs torch >= 99.1 (found "
                                         f"torch {importlib.metadata.version('torch')}): ")
    assert "does not import here" in str(broken.value)
    for env in skip_audit.ALLOWED:
        audit = skip_audit._Audit(env)
        assert audit.allowed.search(str(too_old.value)), env
        assert not audit.allowed.search(str(broken.value)), env


INNER = '''
import pytest

def test_skips_for_an_installed_package():
    pytest.skip("torchtitan is not installed (No module named 'torchtitan')")

def test_skips_for_no_cuda():
    pytest.skip("CUDA not available (torch.cuda.is_available() is False)")

@pytest.mark.xfail(reason="expected", strict=True)
def test_xfails():
    assert False
'''


def _inner_pytest(tmp_path: Path, *args: str):
    (tmp_path / "test_inner.py").write_text(INNER)
    return run_isolated(module="pytest", args=["-p", "no:cacheprovider", "-p", "no:xdist",
                                               "-p", skip_audit.__name__, *args],
                        cwd=str(tmp_path), timeout=120,
                        env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})


def test_the_audit_fails_a_run_that_skipped_for_a_package_its_env_installs(tmp_path):
    r = _inner_pytest(tmp_path, "--skip-audit=cpu")
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:])
    assert "skip audit (tox env cpu): 1 skip for a reason this env does not allow" in r.stdout
    assert "test_inner.py::test_skips_for_an_installed_package: torchtitan is not installed" \
        in r.stdout
    assert "test_skips_for_no_cuda:" not in r.stdout  # allowed on cpu; xfail is no skip
    r = _inner_pytest(tmp_path, "--skip-audit=cpu", "-k", "no_cuda or xfails")
    assert r.returncode == 0, r.stdout[-3000:]
    # a run it lets pass says so too, in one line
    assert "skip audit (tox env cpu): 1 skip, every reason one this env allows" in r.stdout
    r = _inner_pytest(tmp_path, "--skip-audit=gpu", "-k", "no_cuda")  # not on a GPU runner
    assert r.returncode == 1, r.stdout[-3000:]


def test_every_tox_env_that_runs_pytest_audits_its_skips():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    audited = {}
    for section in tox.sections():
        env = section.removeprefix("testenv:")
        for line in tox[section].get("commands", "").splitlines():
            if line.strip().startswith("pytest"):
                audited[env] = line
    assert set(audited) == {"cpu", "deep", "gpu", "bench", "vllm", "verl"}, audited  # verl-080 reuses verl's
    for env, line in audited.items():
        assert f"-p {skip_audit.__name__} --skip-audit={env}" in line, (env, line)
        assert env in skip_audit.ALLOWED


@pytest.mark.parametrize(("reason", "allowed"), [
    ("torchtitan is not installed (No module named 'torchtitan')", True),
    ("torchtitan not installed", True),
    ("mesh-recompute-verl091-init-thread needs torchtitan (not installed)", True),
    ("torchtitan.models does not import here: No module named 'triton'", False),
    ("torchtitan's engine raised RuntimeError: broken", False),
])
def test_the_gpu_env_allows_exactly_torchtitan_not_being_installed(reason, allowed):
    # Before: any reason mentioning torchtitan passed the gpu and vllm envs' audits.
    audit = skip_audit._Audit("gpu")
    assert bool(audit.allowed.search(reason)) is allowed, reason


def test_a_repro_needing_a_newer_torch_than_installed_is_skipped_before_any_child(monkeypatch):
    # On the H200 image (torch 2.11) torchtitan 0.3.0 installs but its trainer does not import:
    # the repros that require it skip with the conflict, as the tests do, instead of failing.
    from repro import runner
    from repro.harness import optional
    from repro.registry import discover

    repro = next(r for r in discover().values() if "torchtitan" in r.requires and "cpu" in r.devices)
    monkeypatch.setattr(type(repro), "missing_requirements", lambda self: [])  # installed
    monkeypatch.setattr(optional.importlib.metadata, "version",
                        lambda name: {"torch": "2.11.0", "torchtitan": "0.3.0"}[name])
    monkeypatch.setattr(optional.importlib.metadata, "requires", lambda name: [])
    reason = runner.skip_reason(repro, "cpu")
    assert reason == "torchtitan 0.3.0 needs torch >= 2.12 (found torch 2.11.0)"
    assert skip_audit._Audit("gpu").allowed.search(reason)
    assert skip_audit._Audit("gpu").allowed.search(f"{repro.name}: {reason}")  # as a test says it
