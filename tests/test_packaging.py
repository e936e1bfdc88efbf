"""What ``pip install stackfix-harness`` adds to an environment -- a training environment among
them (verl's, which its Ray workers share): the import package ``fixes`` and nothing else, so no
top-level name can clash with another distribution's (the index has an unrelated ``repro``),
and the entry points that load it, the users' pytest helpers included. The harness (``repro``,
``benchmarks``, ``tests``) runs from the checkout, and so do the children it starts."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from repro import run_isolated

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ("repro", "benchmarks", "tests")
ENTRY_POINTS = {
    "pytest11": {"stackfix": "fixes.sanitize.pytest_plugin",
                 "stackfix-testing": "fixes.testing.pytest_plugin"},
    "verl.plugins": {"stackfix": "fixes.verl"},
}
# Not part of the source tree (built or fetched next to it).
_NOT_SOURCE = shutil.ignore_patterns(".git", ".tox", ".tox-*", ".ci-bench.log", ".venv",
                                     ".ci-venv", "__pycache__", "build",
                                     "dist", "*.egg-info", ".whl", ".gpu", ".megatron-lm",
                                     ".megatron-main", ".verl-releases", ".pytest_cache",
                                     ".hypothesis", ".benchmarks")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel pip builds from a copy of this checkout (a copy: the build writes build/ and
    *.egg-info next to the sources)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (the build backend of pyproject.toml)")
    source = tmp_path_factory.mktemp("source") / "stackfix"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                           "--no-build-isolation", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("stackfix_harness-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_the_fixes_and_nothing_else(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"fixes"}
    assert "fixes/testing/pytest_plugin.py" in wheel.namelist()


def test_its_entry_points_load_modules_it_ships(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.optionxform = str  # entry point names keep their case
    parser.read_string(wheel.read(name).decode())
    assert {group: dict(parser[group]) for group in parser.sections()} == ENTRY_POINTS
    shipped = set(wheel.namelist())
    for group in ENTRY_POINTS.values():
        for module in group.values():
            path = module.replace(".", "/")
            assert {f"{path}.py", f"{path}/__init__.py"} & shipped, module


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value).split(".")[0])
    return names


def test_fixes_imports_nothing_of_the_harness():
    # The layering rule, and what makes the wheel above work: the harness is not installed.
    offending = {str(p.relative_to(ROOT)): sorted(_imported(p) & set(HARNESS))
                 for p in sorted((ROOT / "fixes").rglob("*.py"))}
    assert {p: names for p, names in offending.items() if names} == {}


@pytest.mark.parametrize("forkserver", [False, True], ids=["spawned", "forked"])
def test_a_child_of_the_harness_finds_this_checkout_from_any_directory(tmp_path, forkserver):
    r = run_isolated(code="import repro; print(repro.__file__)", cwd=str(tmp_path),
                     env={"PYTHONPATH": ""}, timeout=120, forkserver=forkserver)
    assert r.ok, r.stderr[-3000:]
    assert Path(r.stdout.strip()) == ROOT / "repro" / "__init__.py"
