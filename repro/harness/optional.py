"""Importing an optional upstream package (torchtitan, megatron-core, torch_remat, vLLM) for a
test or a benchmark, telling "not usable here" from "broken".

``import_optional(name)`` returns the module, or raises ``OptionalUnavailable`` (its message is
the skip reason) when

* the package is not installed: a ModuleNotFoundError naming the package itself or one of its
  modules, or
* it does not import on this stack: an ImportError that is not a missing module (a name a
  dependency lacks: torchtitan 0.3.0's models on torch 2.11 import ``DataParallelMeshDims``).
  Where the installed torch is older than the package needs (its ``Requires-Dist: torch>=X``,
  or ``TORCH_FLOORS`` for a package that does not declare it), the message says so --
  "``torchtitan 0.3.0 needs torch >= 2.12 (found torch 2.11.0)``" -- a version conflict, which
  the skip audit accepts on any env; an import failure on a torch the package accepts is a
  broken install, and the audit refuses its skip.

Anything else propagates: an import that raises another exception, or a missing dependency of
an installed package, is a broken install, and the run must fail on it rather than skip
(tox's skip audit, repro.harness.skip_audit, then catches skips for a package an env installs).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from types import ModuleType

__all__ = ["OptionalUnavailable", "TORCH_FLOORS", "import_optional", "require", "torch_conflict",
           "torch_floor"]

# The oldest torch a package's release needs, where its metadata does not declare it:
# torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims (torch 2.12).
TORCH_FLOORS: dict[tuple[str, str], str] = {("torchtitan", "0.3.0"): "2.12"}


class OptionalUnavailable(Exception):
    """The optional package is absent or does not import on this stack (the message says which)."""


def import_optional(name: str) -> ModuleType:
    package = name.split(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == package:
            raise OptionalUnavailable(f"{package} is not installed ({exc})") from exc
        if missing.startswith(package + "."):
            raise OptionalUnavailable(f"{package} has no module {missing} ({exc})") from exc
        raise
    except ImportError as exc:
        conflict = torch_conflict(package)
        if conflict:
            raise OptionalUnavailable(f"{conflict}: {name} does not import ({exc})") from exc
        raise OptionalUnavailable(f"{name} does not import here: {exc}") from exc


def _release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.11.0+cu130" -> (2, 11, 0)."""
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def torch_floor(package: str) -> tuple[str, str] | None:
    """(the installed release of ``package``, the oldest torch it needs), or None when it is not
    installed or needs no particular torch: its declared ``torch>=X`` (an unconditional one),
    else ``TORCH_FLOORS``."""
    try:
        version = importlib.metadata.version(package)
        requires = importlib.metadata.requires(package) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"^torch\s*>=\s*([\w.]+)\s*$", req.split(",")[0])
        if m and ";" not in req:
            return version, m.group(1)
    floor = TORCH_FLOORS.get((package, version))
    return (version, floor) if floor else None


def torch_conflict(package: str) -> str:
    """"PACKAGE V needs torch >= X (found torch Y)" when the installed torch is older than what
    ``package`` needs, else ""."""
    need = torch_floor(package)
    try:
        found = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""
    if need is None or _release(found) >= _release(need[1]):
        return ""
    return f"{package} {need[0]} needs torch >= {need[1]} (found torch {found})"


def require(*names: str) -> tuple[ModuleType, ...]:
    """``import_optional`` each of ``names`` in a test module or test; skips (pytest) with the
    reason when one is unavailable."""
    import pytest

    try:
        return tuple(import_optional(name) for name in names)
    except OptionalUnavailable as exc:
        pytest.skip(str(exc), allow_module_level=True)
