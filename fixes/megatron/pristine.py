"""A checkpoint Function's own ``backward``, recovered from its installed module's source.

Why: verl replaces megatron-core's ``CheckpointFunction.backward`` by plain assignment
(``verl/models/mcore/patch.py``, ``apply_patch_megatron_recomputation_backward``; its Megatron
engine calls it in every worker's init). Once that has run, megatron's own function object is
gone from the process, and a patch that wraps whatever ``backward`` it finds wraps verl's unsafe
copy. The reclaim must wrap megatron's own backward in any install order, without a copy of its
body in this repository.

How: the class's source file is the installed module's; ``backward``'s definition in it is
compiled again, as a method of a stand-in class of the same name (so its qualified name and line
numbers are the original's), in the *module's own globals* — it reads the same RNG tracker and
helpers as the original, and its code object compares equal to the original's.
:func:`is_pristine` tells the module's own backward from a replacement by where it is defined
(that file, that line, that qualified name): a replacement is defined somewhere else.
"""

from __future__ import annotations

import ast
import inspect
import sys
import threading
from collections.abc import Callable

__all__ = ["describe", "is_pristine", "pristine_backward"]

_cache: dict[type, Callable] = {}
_lock = threading.Lock()


def pristine_backward(target: type) -> Callable:
    """``target.backward`` as its module's source defines it (a plain function).

    Raises ``TypeError`` when ``target`` is not a reentrant checkpoint Function of the shape
    the reclaim wraps: a ``@staticmethod backward`` that recomputes through
    ``ctx.run_function`` (megatron-core's ``tensor_parallel.random.CheckpointFunction``,
    PyTorch's ``torch.utils.checkpoint.CheckpointFunction``), and ``RuntimeError`` when its
    source cannot be read.
    """
    with _lock:
        if target not in _cache:
            _cache[target] = _compile_backward(target)
        return _cache[target]


def is_pristine(target: type, function: Callable) -> bool:
    """Is ``function`` ``target``'s own backward (not a replacement of it)?"""
    code = getattr(function, "__code__", None)
    original = pristine_backward(target).__code__
    return code is not None and (code.co_filename, code.co_firstlineno, code.co_qualname) == (
        original.co_filename, original.co_firstlineno, original.co_qualname)


def describe(function: object) -> str:
    """``module.qualname (file:line)`` of a function, for messages about what was replaced."""
    fn = getattr(function, "__func__", function)
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', '?')}.{name}{where}"


def _compile_backward(target: type) -> Callable:
    module = sys.modules.get(target.__module__)
    try:
        filename = inspect.getsourcefile(module)
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename)
    except (TypeError, OSError) as e:
        raise RuntimeError(
            f"cannot recover {target.__module__}.{target.__qualname__}.backward: the source of "
            f"{target.__module__} is not readable ({e})"
        ) from None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == target.__name__),
               None)
    fn = None if cls is None else next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "backward"), None)
    if fn is None or not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                             for d in fn.decorator_list):
        raise TypeError(
            f"{target.__module__}.{target.__qualname__} has no @staticmethod backward in "
            f"{filename}; not a reentrant checkpoint Function the reclaim can wrap"
        )
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
    backward = scope[cls.name].__dict__["backward"].__func__
    if "run_function" not in backward.__code__.co_names:
        raise TypeError(
            f"{target.__module__}.{target.__qualname__}.backward does not recompute through "
            "ctx.run_function; not a reentrant checkpoint Function the reclaim can wrap"
        )
    return backward
