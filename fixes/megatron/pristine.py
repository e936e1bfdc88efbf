"""A checkpoint Function's own ``backward``: the function object this process imported.

Why: verl replaces megatron-core's ``CheckpointFunction.backward`` by plain assignment
(``verl/models/mcore/patch.py``, ``apply_patch_megatron_recomputation_backward``; its Megatron
engine calls it in every worker's init). Once that has run, megatron's own function object is
gone from the process, and a patch that wraps whatever ``backward`` it finds wraps verl's
unsafe copy. The reclaim must wrap megatron's own backward in any install order, without a
copy of its body in this repository.

How, in order of preference:

1. stackfix keeps a reference to the module's own backward the first time it sees it in place
   (:func:`remember_own_backward`; every reclaim call that looks at the class does, and the verl
   plugin does as soon as megatron-core's ``tensor_parallel.random`` is imported), so a later
   assignment cannot take it away.
2. Only when it was replaced before stackfix ever saw it is its definition compiled again from
   the module's source file -- as a method of a stand-in class of the same name, in the
   module's own globals, so its code is the original's -- and only when that file provably has
   not changed since this process started (its modification time is older than the process).
   A file edited on disk after the import (a ``git pull`` of a Megatron-LM dev tree while a job
   runs) is refused with a ``RuntimeError``: a body the process never ran is never installed.

:func:`is_own_backward` tells the module's own backward from a replacement by where it is
defined (the module's source file and the method's qualified name), not by line numbers: an
edit of the file on disk moves lines, not the function the process runs.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["describe", "is_own_backward", "own_backward", "recover_from_source",
           "remember_own_backward"]

_own: dict[type, staticmethod] = {}  # the very descriptor the class had (undo puts it back)
_lock = threading.Lock()


def _source_file(target: type) -> str | None:
    module = sys.modules.get(target.__module__)
    try:
        return inspect.getsourcefile(module) if module is not None else None
    except TypeError:  # a built-in or a module without a file
        return None


def is_own_backward(target: type, function: Callable | None) -> bool:
    """Is ``function`` ``target``'s own backward, defined in its module's source file as
    ``<class>.backward`` (not a replacement assigned from somewhere else)?"""
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    return (code.co_qualname == f"{target.__qualname__}.backward"
            and getattr(function, "__module__", None) == target.__module__
            and code.co_filename == _source_file(target))


def _check_shape(target: type, backward: Callable) -> Callable:
    if "run_function" not in backward.__code__.co_names:
        raise TypeError(
            f"{target.__module__}.{target.__qualname__}.backward does not recompute through "
            "ctx.run_function; not a reentrant checkpoint Function the reclaim can wrap")
    return backward


def remember_own_backward(target: type) -> bool:
    """Keep ``target``'s own backward if it is in place now (and none is kept yet): True when
    one is kept after the call."""
    current = target.__dict__.get("backward")
    function = getattr(current, "__func__", None)
    with _lock:
        if target not in _own and isinstance(current, staticmethod) and is_own_backward(
                target, function):
            _check_shape(target, function)
            _own[target] = current
        return target in _own


def own_backward(target: type) -> staticmethod:
    """``target``'s own ``backward`` descriptor: the one kept, the one in place, or -- if it was
    replaced before stackfix saw it -- one for the function its unchanged source file defines.

    Raises ``TypeError`` when ``target`` is not a reentrant checkpoint Function of the shape
    the reclaim wraps (a ``@staticmethod backward`` that recomputes through
    ``ctx.run_function``: megatron-core's ``tensor_parallel.random.CheckpointFunction``,
    PyTorch's ``torch.utils.checkpoint.CheckpointFunction``), and ``RuntimeError`` when its own
    backward is gone and its source cannot be trusted or read.
    """
    if remember_own_backward(target):
        return _own[target]
    recovered = staticmethod(recover_from_source(target))
    with _lock:
        return _own.setdefault(target, recovered)


def describe(function: object) -> str:
    """``module.qualname (file:line)`` of a function, for messages about what was replaced."""
    fn = getattr(function, "__func__", function)
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', '?')}.{name}{where}"


# --- recovery from the source file ---------------------------------------------------------------


def _process_started_at() -> float | None:
    """This process's start (seconds since the epoch), from Linux's /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # fields after the command name (which may hold spaces): field 22 is the start time
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# /proc gives the boot time in whole seconds: a file modified this close to the start is not
# provably older than the process.
_CLOCK_SLACK_S = 2.0


def _check_unchanged_since_start(target: type, filename: str) -> None:
    started = _process_started_at()
    modified = os.stat(filename).st_mtime
    if started is None or modified > started - _CLOCK_SLACK_S:
        when = ("after this process started" if started is not None
                else "(this platform gives no process start time to compare with)")
        raise RuntimeError(
            f"{target.__module__}.{target.__qualname__}.backward was replaced before stackfix "
            f"saw it, and its source file {filename} changed on disk {when}: stackfix will not "
            "install a body this process may never have imported. Let stackfix see megatron's "
            "own backward first (the verl plugin does: install it, or import fixes.verl before "
            "verl's engine starts; or call apply_recompute_reclaim_patch() before anything "
            "replaces the backward), or restart the process.")


def recover_from_source(target: type) -> Callable:
    """``target.backward`` compiled again from its module's source file, which must be older
    than this process (``RuntimeError`` otherwise, or when it cannot be read)."""
    module = sys.modules.get(target.__module__)
    filename = _source_file(target)
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename)
    except (TypeError, OSError) as e:
        raise RuntimeError(
            f"cannot recover {target.__module__}.{target.__qualname__}.backward: the source of "
            f"{target.__module__} is not readable ({e})") from None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == target.__name__),
               None)
    fn = None if cls is None else next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "backward"), None)
    if fn is None or not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                             for d in fn.decorator_list):
        raise TypeError(
            f"{target.__module__}.{target.__qualname__} has no @staticmethod backward in "
            f"{filename}; not a reentrant checkpoint Function the reclaim can wrap")
    _check_unchanged_since_start(target, filename)
    # A stand-in class holding only `backward`: the method's qualified name and line numbers
    # are the original's. The module's own top-level imports come first, so the compiler emits
    # the same bytecode (it compiles calls on imported modules differently); executing them binds
    # only into `scope`, nothing in the module.
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    stand_in = ast.copy_location(
        ast.ClassDef(name=cls.name, bases=[], keywords=[], body=[fn], decorator_list=[]), cls)
    code = compile(ast.Module(body=[*imports, stand_in], type_ignores=[]), filename, "exec",
                   dont_inherit=True)
    scope: dict = {}
    exec(code, module.__dict__, scope)  # the module's globals: its RNG tracker, its helpers
    return _check_shape(target, scope[cls.name].__dict__["backward"].__func__)
