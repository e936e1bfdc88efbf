"""Importing an optional upstream package (torchtitan, megatron-core, torch_remat, vLLM) for a
test or a benchmark, telling "not usable here" from "broken".

``import_optional(name)`` returns the module, or raises ``OptionalUnavailable`` (its message is
the skip reason) when

* the package is not installed: a ModuleNotFoundError naming the package itself or one of its
  modules, or
* it does not import on this stack: an ImportError that is not a missing module (a name a
  dependency lacks: torchtitan 0.3.0's models on torch 2.11 import ``DataParallelMeshDims``).

Anything else propagates: an import that raises another exception, or a missing dependency of
an installed package, is a broken install, and the run must fail on it rather than skip
(tox's skip audit, repro.harness.skip_audit, then catches skips for a package an env installs).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["OptionalUnavailable", "import_optional", "require"]


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
        raise OptionalUnavailable(f"{name} does not import here: {exc}") from exc


def require(*names: str) -> tuple[ModuleType, ...]:
    """``import_optional`` each of ``names`` in a test module or test; skips (pytest) with the
    reason when one is unavailable."""
    import pytest

    try:
        return tuple(import_optional(name) for name in names)
    except OptionalUnavailable as exc:
        pytest.skip(str(exc), allow_module_level=True)
