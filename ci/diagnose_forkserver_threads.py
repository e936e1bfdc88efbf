"""Which import leaves a second OS thread in a fork server's process (the server refuses to fork
then: ``the fork server has N threads, not 1``), and what that thread is called.

    python ci/diagnose_forkserver_threads.py [PROFILE]   # default "torch"

Imports the profile's modules (repro.harness.forkserver.PRELOADS) under the server's environment,
one by one, with an import hook that counts ``/proc/self/task`` after every module any of them
imports, and prints the first module after which the count grew, with the threads' names
(``/proc/self/task/*/comm``). Linux only.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from repro.harness.forkserver_process import _thread_names as _threads  # noqa: E402


class _Watch(importlib.abc.MetaPathFinder):
    """After each module's execution, note the first one after which a thread appeared."""

    def __init__(self):
        self.first: tuple[str, list[str]] | None = None
        self.stack: list[str] = []

    def find_spec(self, name, path, target=None):
        if self.first is not None or name in self.stack:
            return None
        self.stack.append(name)
        try:
            spec = importlib.util.find_spec(name) if "." not in name else None
        finally:
            self.stack.pop()
        if spec is None or spec.loader is None:
            return None
        loader, watch = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                if watch.first is None and len(threads := _threads()) > 1:
                    watch.first = (module.__name__, threads)

        spec.loader = _Loader()
        return spec


def main() -> int:
    profile = sys.argv[1] if len(sys.argv) > 1 else "torch"
    from repro.harness import forkserver

    if profile not in forkserver.PRELOADS:
        print(f"error: unknown profile {profile!r}; known: {', '.join(forkserver.PRELOADS)}",
              file=sys.stderr)
        return 2

    os.environ.update(forkserver._SERVER_ENV)
    watch = _Watch()
    sys.meta_path.insert(0, watch)
    for name in forkserver.PRELOADS[profile]:
        start = time.perf_counter()
        importlib.import_module(name)
        print(f"import {name}: {time.perf_counter() - start:.2f} s, threads now {_threads()}")
    if watch.first is None:
        print("no import left a second thread")
    else:
        module, threads = watch.first
        print(f"first module after which there was more than one thread: {module} ({threads})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
