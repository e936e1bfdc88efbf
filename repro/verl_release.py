"""verl's own released code, one leaf module at a time: the unfixed path of a repro *is* verl.

verl ships pure-python wheels; a release lives unpacked at ``<root>/<version>/verl/...``::

    python -m repro.verl_release install [--root DIR] [VERSION ...]   # default: RELEASES

which runs ``pip install --no-deps --target <root>/<version> verl==<version>`` per version.
``<root>`` is ``$STACKFIX_VERL_ROOT``, else ``~/.cache/stackfix/verl-releases`` (tox sets it
to a directory inside its env).

``import_verl("0.9.1", "verl.models.mcore.patch")`` returns that file of that release, executed
exactly as released. verl's package ``__init__`` files are *not* executed: ``import verl`` pulls
ray, hydra, transformers, tensordict, datasets... none of which the patches under test need
(``verl/models/mcore/patch.py`` has no module-level import at all). Instead every verl package
(``verl``, ``verl.models``, ...) becomes an empty package module whose ``__path__`` points into
the release, so a leaf's own ``from verl.x.y import z`` loads leaf ``x/y.py`` of the same release.
A leaf that needs a name defined in a package ``__init__`` fails with the ImportError naming it.

One release per process (repros run each in a child process): a second version is refused.

``released_function(version, module, qualname, namespace)`` is the narrower path for a leaf
that cannot be imported on the stack under test: it compiles one function of the released
file, and nothing else of it (see its docstring).
"""

from __future__ import annotations
import __future__

import argparse
import ast
import builtins
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import symtable
import sys
from pathlib import Path
from types import ModuleType

from repro.registry import Skipped

__all__ = [
    "ENV_ROOT",
    "RELEASES",
    "VerlInstallError",
    "VerlUnavailable",
    "VerlVersionConflict",
    "import_verl",
    "install",
    "loaded_version",
    "missing_release",
    "release_dir",
    "released_function",
    "require_release",
    "verl_root",
]

ENV_ROOT = "STACKFIX_VERL_ROOT"
DEFAULT_ROOT = Path("~/.cache/stackfix/verl-releases")
RELEASES = ("0.8.0", "0.9.1")  # the releases the repros and tests compare


class VerlUnavailable(Skipped, ImportError):
    """The requested verl release is not installed under the root; the message says how to.
    A ``repro.Skipped``: a repro that needs the release is reported skipped with that reason."""


class VerlInstallError(RuntimeError):
    """pip could not install a release (the message says which, and where)."""


class VerlVersionConflict(RuntimeError):
    """This process already imports another verl release (or a regular ``import verl``)."""


def verl_root() -> Path:
    return Path(os.environ.get(ENV_ROOT) or DEFAULT_ROOT).expanduser()


def release_dir(version: str, root: Path | None = None) -> Path:
    """Where ``install`` puts ``version`` (``<root>/<version>``), installed or not."""
    return (verl_root() if root is None else Path(root)) / version


def missing_release(version: str) -> str | None:
    """Why release ``version`` cannot be used (not installed, and how to install it), or None:
    the reason tests and benchmarks skip with."""
    where = release_dir(version)
    if (where / "verl" / "__init__.py").is_file() and (
        where / f"verl-{version}.dist-info"
    ).is_dir():
        return None
    return (f"verl {version} is not installed under {where.parent} (${ENV_ROOT}); install it with "
            f"`python -m repro.verl_release install --root {where.parent} {version}`")


def require_release(version: str) -> Path:
    """The directory of release ``version``; VerlUnavailable if it is not installed."""
    why = missing_release(version)
    if why is not None:
        raise VerlUnavailable(why)
    return release_dir(version)


class _ReleaseFinder(importlib.abc.MetaPathFinder):
    """Resolves ``verl`` and ``verl.*`` from one release directory, packages as empty modules."""

    def __init__(self, version: str, where: Path):
        self.version, self.where = version, where

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "verl" and not fullname.startswith("verl."):
            return None
        base = self.where.joinpath(*fullname.split("."))
        if base.is_dir():
            spec = importlib.machinery.ModuleSpec(fullname, _EmptyPackage(), is_package=True)
            spec.submodule_search_locations = [str(base)]
            return spec
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        return None


class _EmptyPackage(importlib.abc.Loader):
    """A verl package without its ``__init__``: only ``__path__`` (set from the spec)."""

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module):
        pass


_finder: _ReleaseFinder | None = None


def loaded_version() -> str | None:
    """The verl release this process imports from (None until ``import_verl``)."""
    return None if _finder is None else _finder.version


def import_verl(version: str, module: str) -> ModuleType:
    """``module`` (e.g. ``"verl.models.mcore.patch"``) from verl ``version``, as released.

    Raises VerlUnavailable if that release is not installed, VerlVersionConflict if this
    process already uses another release or imported verl the regular way.
    """
    global _finder
    if module != "verl" and not module.startswith("verl."):
        raise ValueError(f"not a verl module: {module!r}")
    if _finder is None:
        if "verl" in sys.modules:
            raise VerlVersionConflict(
                f"verl is already imported in this process from {sys.modules['verl'].__file__}; "
                f"import_verl needs a process without it"
            )
        _finder = _ReleaseFinder(version, require_release(version))
        sys.meta_path.insert(0, _finder)
    elif _finder.version != version:
        raise VerlVersionConflict(
            f"this process already imports verl {_finder.version}; one verl release per process "
            f"(run verl {version} in a child process)"
        )
    return importlib.import_module(module)


def released_function(version: str, module: str, qualname: str, namespace: dict):
    """One function of verl ``version``'s released ``module`` file, compiled from that file's
    bytes, its global names resolved in ``namespace`` (nothing else of the module runs).

    Why: some leaves cannot be imported on the stack a repro runs on. verl 0.9.1's
    ``verl/workers/engine/torchtitan/transformer_impl.py`` imports torchtitan names that
    torchtitan 0.3.0 lacks (``torchtitan.components.lr_scheduler``), ``torchtitan.train``
    (which does not import on torch 2.11), tensordict and a dozen verl modules -- while the
    function under test, ``TorchTitanEngine._init_device_mesh``, reads only ``torch`` and
    ``ParallelDims``. Compiling that one ``def`` (a method is a plain function; call it with any
    object holding the attributes it reads) runs verl's code as released, with no copy of it in
    this repository. Tracebacks point at the released file and line.

    ``qualname`` is ``"func"`` or ``"Class.method"``. Raises VerlUnavailable if the release is
    not installed, LookupError if the file has no such function, ValueError if it reads a
    global (decorators included) that is neither in ``namespace`` nor a builtin (named, so
    nothing fails halfway), or calls ``super()`` (it needs the class, which is not built).
    """
    path = require_release(version).joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        raise LookupError(f"verl {version} has no module {module} ({path})")
    source = path.read_text(encoding="utf-8")
    body = ast.parse(source, filename=str(path)).body
    # The file's own ``from __future__`` imports apply to the def (e.g. lazy annotations).
    futures = [n for n in body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    flags = 0
    for n in futures:
        for alias in n.names:
            flags |= getattr(__future__, alias.name).compiler_flag
    *classes, name = qualname.split(".")
    for part in classes:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == part), [])
    node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    if node is None:
        raise LookupError(f"verl {version}: {module} has no function {qualname} ({path})")
    # What the def reads from its module: decorators (top level) and the body's globals.
    top = symtable.symtable(ast.unparse(ast.Module(body=[*futures, node], type_ignores=[])),
                            str(path), "exec")
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    read |= _global_reads(next(t for t in top.get_children() if t.get_name() == name))
    if "super" in read:
        raise ValueError(f"{qualname} uses super(); released_function cannot build its class")
    missing = sorted(n for n in read if n not in namespace and not hasattr(builtins, n))
    if missing:
        raise ValueError(f"verl {version} {module}.{qualname} reads globals {missing}: "
                         "pass them in namespace")
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec", flags=flags,
                   dont_inherit=True)
    scope = {**namespace, "__name__": module, "__file__": str(path)}
    exec(code, scope)  # noqa: S102 - verl's released bytes, the point of this loader
    function = scope[name]
    function.__qualname__ = qualname
    return function


def _global_reads(table: symtable.SymbolTable) -> set[str]:
    """Global names a function (and anything nested in it) reads."""
    names = {s.get_name() for s in table.get_symbols() if s.is_global()}
    for child in table.get_children():
        names |= _global_reads(child)
    return names


def _installer() -> list[str]:
    """uv's pip where uv is on PATH (the tox envs are uv venvs, which have no pip), else pip."""
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--python", sys.executable]
    return [sys.executable, "-m", "pip", "install"]


def install(versions=RELEASES, root: Path | None = None) -> list[Path]:
    """``pip install --no-deps --target <root>/<version> verl==<version>`` (through uv where it
    is on PATH) for each version not installed yet (pure-python wheels, ~1.5 MB each). Returns
    the release directories; VerlInstallError when the installer fails."""
    root = verl_root() if root is None else Path(root)
    done = []
    for version in versions:
        where = release_dir(version, root)
        if (where / f"verl-{version}.dist-info").is_dir():
            print(f"verl {version}: already installed in {where}")
        else:
            cmd = [*_installer(), "--no-deps", "--target", str(where),
                   f"verl=={version}"]
            print("+", " ".join(cmd), flush=True)
            status = subprocess.run(cmd).returncode
            if status != 0:
                raise VerlInstallError(f"pip could not install verl=={version} into {where} "
                                       f"(exit status {status}; its output above)")
        done.append(where)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.verl_release")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="pip install --no-deps --target ROOT/VERSION verl==VERSION")
    p.add_argument("--root", type=Path, default=None,
                   help=f"default: ${ENV_ROOT}, else {DEFAULT_ROOT}")
    p.add_argument("versions", nargs="*", default=list(RELEASES), metavar="VERSION",
                   help=f"one of {', '.join(RELEASES)} (default: all)")
    args = parser.parse_args(argv)
    for version in args.versions:
        if version not in RELEASES:
            p.error(f"verl {version} is not one of the releases the repros compare: "
                    f"{', '.join(RELEASES)}")
    try:
        install(args.versions, args.root)
    except VerlInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
