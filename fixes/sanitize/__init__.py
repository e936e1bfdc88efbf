"""Sanitizers that turn silent corruption into a named Python error, for any program or test
suite (``pytest --stackfix-sanitize``).

Importing the package imports nothing: each public name loads its module (and torch) when it
is first used. The pytest plugin in this package loads in every pytest session of an
environment with stackfix installed, and a session that never asks for the sanitizers must not
pay for torch. spmd_types (and torchtitan, where installed) are looked up only when
``mesh_sanitizer()`` is entered.
"""

from __future__ import annotations

import importlib

_MODULE_OF = {
    "MeshLostError": "mesh",
    "MeshSanitizer": "mesh",
    "mesh_sanitizer": "mesh",
    "RecomputeMismatchError": "recompute",
    "RecomputeSanitizer": "recompute",
    "RecomputeSanitizerWarning": "recompute",
    "recompute_sanitizer": "recompute",
    # no torch import: code that declares its intended differences pays nothing for it
    "recompute_may_differ": "_intended",
    "scratch_tensors": "_intended",
    "ReleasedStorageError": "storage",
    "StorageRelease": "storage",
    "StorageSanitizer": "storage",
    "storage_sanitizer": "storage",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    # PEP 562: called only for names not yet in the module's globals.
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
