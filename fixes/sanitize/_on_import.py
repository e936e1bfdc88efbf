"""Run a callback on a module right after it is imported (for seams in packages that may be
imported only once a sanitizer is active, e.g. megatron-core)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable


class OnImport(importlib.abc.MetaPathFinder):
    """While in ``sys.meta_path``: ``callbacks[name](module)`` after ``name`` is executed."""

    def __init__(self, callbacks: dict[str, Callable]):
        self.callbacks = callbacks

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CallingLoader(spec.loader, self.callbacks[fullname])
                return spec
        return None


class _CallingLoader(importlib.abc.Loader):
    def __init__(self, inner, callback: Callable):
        self.inner, self.callback = inner, callback

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.callback(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self.inner, name)
