"""Which modules a checkpointed region's forward ran: the detect tier narrows what the region
reaches to them (``_reach``).

Why: megatron's ``TransformerBlock`` checkpoints each layer with the whole block in the
region's closure (``self._get_layer(index)`` in ``_checkpointed_forward``'s ``custom``), so a
region that reached every module its closure holds reached every layer's parameters and
routing state: a region's host time grew with the model's depth and a step's with its square
(``python -m benchmarks.sanitizer_host_time --layers``), and a frozen bottom layer
checkpointed by ``recompute_method="block"`` was said to leave the trainable layers above it
without a gradient (the never-recomputed check read the block's parameters as the region's).

How: one global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``)
held only while some region's forward runs, appending each module called to the calling
thread's record; a region's recording is the slice of its thread's record made while it was
open (a nested region's calls are its outer region's too; another thread's are not). Outside a region's forward no hook is registered: a module call takes
torch's fast path, and a sanitizer entered with no region run costs nothing here. A module
whose ``forward`` is called directly (not through ``__call__``) is not recorded: a root none
of whose modules ran is reached whole, and one narrowed to the modules that ran keeps the own
state of every module between it and them (``_reach.narrowed``).
A ``torch.compile``d module called inside a region keeps its graph (the hook's coming and
going compiles nothing again); torch warns there, once per call site, that global hooks fire
twice for an ``OptimizedModule`` (the record counts each module once).

Lent: while the hook is held every module call of the forward takes torch's slow path (on
megatron's MoE a third of ``values="none"``'s Python calls a region). In ``sampled`` and
``none`` a region takes the record of the last region of its ``identity`` -- call site,
position in its round, its function's code and what its closure holds, its plain arguments
-- made fewer than ``REWALK_ROUNDS`` rounds ago with no parameter, buffer or module
registered since (``_reach.Walks.ran``), and its forward records nothing. A forward that runs
other modules than its identity's last recorded one (control flow on data) is narrowed to
those until its identity records again: writes outside the region missed there, none
invented. ``all`` records every forward; a region whose never-recomputed check needs the
record (``recompute``) records it.
"""

from __future__ import annotations

import functools
import threading
import types

import torch

__all__ = ["ModulesRun", "by_value", "frozen", "function_identity", "identity"]

_VALUES = (type(None), bool, int, float, str, bytes)  # compared by value, not by object
_CONTAINERS = (list, tuple, dict)  # exactly these types, not subclasses
_FROZEN_ITEMS = 8  # a container's most items read for its value
_FROZEN_DEPTH = 2  # containers in containers, at most
_NOT_FROZEN = object()


def frozen(obj, depth: int = 0) -> object:
    """``obj`` as a value: a plain value (``_VALUES``) with its type (1, 1.0 and True told
    apart), or a list, tuple or dict of at most ``_FROZEN_ITEMS`` such values (and such
    containers, ``_FROZEN_DEPTH`` levels deep), with its type and items in order (a dict's
    keys plain values too); ``_NOT_FROZEN`` for anything else. Why: megatron-core 0.19's
    selective attention recompute closes over a new ``{}`` and ``[]`` each call
    (``core_attention_extra_kwargs``, ``tensor_kwarg_names``); told by object, each call was
    a new identity, and nothing read from the identity's last region held (the modules its
    forward ran, its plan, its arguments' slots). Nothing under such a container can be
    reached (``_reach._roots`` skips it), and one holding anything else -- a tensor, a module,
    a callable -- is told by object, so a tensor put into it later makes another identity."""
    kind = type(obj)
    if kind in _VALUES:
        return kind, obj
    if kind not in _CONTAINERS or depth >= _FROZEN_DEPTH or len(obj) > _FROZEN_ITEMS:
        return _NOT_FROZEN
    items = obj.items() if kind is dict else obj
    out = []
    for item in items:
        if kind is dict:
            key, item = item
            if type(key) not in _VALUES:
                return _NOT_FROZEN
            out.append((type(key), key))
        value = frozen(item, depth + 1)
        if value is _NOT_FROZEN:
            return _NOT_FROZEN
        out.append(value)
    return kind, tuple(out)


def by_value(obj) -> bool:
    """``obj`` is told by its value in a region's identity (``frozen``)."""
    return frozen(obj) is not _NOT_FROZEN


def _part(obj) -> object:
    value = frozen(obj)
    return id(obj) if value is _NOT_FROZEN else value


def _cell(cell) -> object:
    try:
        return _part(cell.cell_contents)
    except ValueError:  # an empty cell
        return None


def identity(fn, args=(), kwargs=None) -> tuple:
    """What tells a region's function apart from another's at one call site, by identity, not
    by reading it: a module or other callable object itself; a bound method's function and
    object; a function's code and what its closure cells and default arguments hold; a
    partial's function and arguments -- plain values (None, bool, int, float, str, bytes), and
    small lists, tuples and dicts of them (``frozen``), by value, anything else by identity --
    and the region's plain arguments (megatron's
    ``custom(start, end)`` makes a new closure per layer each step: its code and cells'
    contents are the layer's). Equal
    identities at one call site and round position are taken to run the same modules
    (``_reach.Walks.ran``); where that is wrong, what the region reaches is narrowed to
    another region's modules -- writes outside the region missed, none invented -- for at most
    ``REWALK_ROUNDS`` rounds."""
    key = function_identity(fn)
    plain = tuple((type(a), a) for a in args if type(a) in _VALUES)
    if kwargs:
        plain += tuple((k, type(v), v) for k, v in kwargs.items() if type(v) in _VALUES)
    return key, plain


def function_identity(fn) -> object:
    """``identity``'s part that is the function's own (``identity(fn, args)[0]``): read again
    at the recompute, it tells whether the function's closure changed since its call."""
    if isinstance(fn, types.MethodType):
        key = (id(fn.__func__), id(fn.__self__))
    elif isinstance(fn, types.FunctionType):
        key = (id(fn.__code__), tuple(map(_cell, fn.__closure__ or ())),
               tuple(map(_part, fn.__defaults__ or ())))
    elif isinstance(fn, functools.partial):
        key = (identity(fn.func), tuple(map(_part, fn.args)),
               tuple((k, _part(v)) for k, v in fn.keywords.items()))
    else:
        key = id(fn)
    return key


class ModulesRun:
    """The modules called while a region's forward runs: ``with run.recording() as ran:``
    leaves in ``ran`` each module called inside on this thread (a ``list``, first call first,
    each once). Recordings nest (an inner region's calls are its outer region's too) and may
    be open on several threads at once, each recording its own thread's calls: a call another
    thread makes meanwhile is no module this region ran (taken for one, it narrowed a root the
    region reads without calling any of its modules, which is reached whole)."""

    def __init__(self):
        self._open = 0  # recordings open, every thread: the hook is held while any is
        self._handle = None
        self._lock = threading.Lock()
        self._closed = 0  # recordings begun before the last ``close`` end as no-ops
        self._local = threading.local()  # per thread: calls (None: none open), depth, closed

    def _called(self, module: torch.nn.Module, _args) -> None:
        calls = getattr(self._local, "calls", None)
        if calls is not None:
            calls.append(module)  # returns None: the arguments are left as they are

    def recording(self) -> _Recording:
        return _Recording(self)

    def close(self) -> None:
        """The hook removed, whatever recording is still open (a region's forward left
        suspended: a checkpoint generator driven by hand and never resumed); each thread's
        record is dropped at its next recording. The sanitizer's exit calls it."""
        with self._lock:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            self._open = 0
            self._closed += 1


class _Recording:
    __slots__ = ("_run", "_start", "_closed", "modules")

    def __init__(self, run: ModulesRun):
        self._run = run
        self.modules: list[torch.nn.Module] = []

    def __enter__(self) -> list[torch.nn.Module]:
        run = self._run
        with run._lock:
            if run._open == 0:
                run._handle = torch.nn.modules.module.register_module_forward_pre_hook(
                    run._called)
            run._open += 1
            self._closed = run._closed
        local = run._local
        if getattr(local, "closed", None) != self._closed:  # first here, or since a close
            local.calls, local.depth, local.closed = None, 0, self._closed
        if local.depth == 0:
            local.calls = []
        local.depth += 1
        self._start = len(local.calls)
        return self.modules

    def __exit__(self, *exc) -> bool:
        run = self._run
        with run._lock:
            if self._closed != run._closed:  # closed under it: nothing to record or remove
                return False
            run._open -= 1
            if run._open == 0:
                run._handle.remove()
                run._handle = None
        local = run._local
        calls = getattr(local, "calls", None)
        if calls is None or getattr(local, "closed", None) != self._closed:
            return False  # ended on another thread than it began: nothing of its own
        # by identity: a module class may define __eq__ / __hash__
        self.modules.extend({id(m): m for m in calls[self._start:]}.values())
        local.depth -= 1
        if local.depth == 0:
            local.calls = None
        return False
