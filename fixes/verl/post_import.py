"""Run a callback on a module right after it is imported (now, if it already is).

The verl plugin loads while ``import verl`` runs, before the modules it patches exist: verl's
Megatron patches (``verl.models.mcore``) import megatron-core, its TorchTitan engine imports
torchtitan, and importing them from the plugin would make ``import verl`` pay for (or fail on)
stacks the user may not use. So each patch waits for its module: a ``sys.meta_path`` finder
resolves the module through the other finders as usual and wraps the loader, whose
``exec_module`` runs the module as shipped and then the callbacks. A module whose import fails
keeps its callbacks for the next attempt. After the callbacks the module's own loader is put
back on its spec, so nothing downstream sees the wrapper.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType

__all__ = ["pending", "when_imported"]

Callback = Callable[[ModuleType], None]
_pending: dict[str, list[Callback]] = {}
_lock = threading.RLock()


def when_imported(name: str, callback: Callback) -> None:
    """``callback(module)`` as soon as module ``name`` has been imported: at once if it is in
    ``sys.modules`` (and not half-initialized), else right after its import runs."""
    with _lock:
        module = sys.modules.get(name)
        initializing = getattr(getattr(module, "__spec__", None), "_initializing", False)
        if module is None or initializing:
            _pending.setdefault(name, []).append(callback)
            if not any(f is _FINDER for f in sys.meta_path):
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)


def pending() -> tuple[str, ...]:
    """The modules that callbacks still wait for."""
    with _lock:
        return tuple(_pending)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__spec__.loader = module.__loader__ = self._loader
        with _lock:
            callbacks = _pending.pop(module.__name__, [])
        for callback in callbacks:
            callback(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


_FINDER = _PostImportFinder()
