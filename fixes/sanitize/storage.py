"""``storage_sanitizer()``: an op that would read or write memory given back by
``UntypedStorage.resize_`` raises ``ReleasedStorageError`` before its kernel runs (what is
tracked, and how a tensor is found to lie in released memory: fixes.sanitize._released).

Why: verl's recompute reclaim (verl #5251, #7328) ``resize_(0)``\\ s storages that chunk views
share; the later reader dies with SIGSEGV on CPU or a CUDA illegal memory access, far from the
release, or reads garbage once the storage is grown again. Nothing in PyTorch names the culprit.

How, while active: ``torch.UntypedStorage.resize_`` is wrapped to record every shrink with its
Python call site, and a ``TorchDispatchMode`` checks the tensor arguments of every op against the
released storages that are still alive; a view op (which reads nothing, but whose own bounds
check fails on a released storage) is checked when torch refuses it. The mode is in force on the
thread that entered, on every ``threading.Thread`` started while it is active (pools
included), and on autograd's device threads for the backward passes those threads run
(PyTorch propagates the dispatch modes there). Until a shrink is recorded (and again once every
released storage is gone) the mode only forwards each op: the fast path. The reads that bypass
the dispatcher are guarded the same way (``tolist``, ``numpy``); ``repr`` of a released tensor
says ``<released storage>`` instead of reading it, also after the sanitizer has exited while
the storage lives (traceback printers call it on the error's frames once the ``with`` block is
left: fixes.sanitize._safe_repr).

Triton kernel launches from Python (``JITFunction.run``) have their tensor arguments checked
too, where triton was imported before the sanitizer was entered.

Not seen: ops on threads that were already running when it was entered, ops inside
torch.compile'd regions, shrinks made from C++, and other code that reads ``data_ptr()``
directly (C++ extensions, Triton kernels launched from C++ or compiled code): no dispatcher
call to check.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from fixes.sanitize import _safe_repr
from fixes.sanitize._callsite import ActiveSlot, call_site
from fixes.sanitize._released import (
    OVERWRITE_OPS,
    PLAIN,
    ReleasedStorageError,
    StorageRelease,
    StorageSanitizer,
    checkable,
)

__all__ = ["ReleasedStorageError", "StorageRelease", "StorageSanitizer", "storage_sanitizer"]


# Ops that touch no element of their tensor arguments and cannot fail on released memory.
_NO_DATA_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("detach", "alias", "set_", "resize_", "record_stream", "empty_like", "new_empty",
                 "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
                 "new_ones", "new_full", "rand_like", "randn_like", "randint_like",
                 "is_same_size", "_has_same_storage_numel", "sym_size", "sym_stride",
                 "sym_numel", "sym_storage_offset")
    if hasattr(torch.ops.aten, name)
)


class _OpKinds:
    """Per op overload, computed once: does it touch no data, is it a view (it reads none but
    torch's own bounds check fails on released memory), and which arguments it overwrites."""

    def __init__(self) -> None:
        self._known: dict = {}

    def __call__(self, func) -> tuple[bool, bool, tuple[bool, ...]]:
        known = self._known.get(func)
        if known is None:
            no_data = func.overloadpacket in _NO_DATA_OPS
            overwrites = tuple(
                a.alias_info is not None and a.alias_info.is_write
                and (a.name.startswith("out") or (i == 0 and func.overloadpacket in OVERWRITE_OPS))
                for i, a in enumerate(func._schema.arguments)
            )
            known = self._known[func] = (no_data, func.is_view, overwrites)
        return known


def _arguments(func, args, kwargs, overwrites):
    """(is it overwritten by the op, value) for every schema argument of one call."""
    for i, a in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name)
        yield overwrites[i], value


class _CheckReleasedStorage(TorchDispatchMode):
    def __init__(self, sanitizer: StorageSanitizer, resize_storage_bytes, kinds: _OpKinds) -> None:
        super().__init__()
        self.sanitizer = sanitizer
        self.resize_storage_bytes = resize_storage_bytes  # torch.compile / FSDP2's resize op
        self.kinds = kinds

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Otherwise torch.compile refuses to compile under a user mode (and fullgraph=True
        # fails); compiled regions run unchecked, their eager callers stay checked.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True
        kwargs = kwargs or {}
        for t in types:
            if t not in PLAIN:
                if is_traceable_wrapper_subclass_type(t):  # DTensor & co: let it unwrap first;
                    return NotImplemented  # this mode then sees the ops on its inner tensors
                return func(*args, **kwargs)  # FakeTensor, FunctionalTensor: no real storage
        sanitizer = self.sanitizer
        if func is self.resize_storage_bytes:
            storage = args[0].untyped_storage()
            before, data_ptr = storage.nbytes(), _data_ptr(storage)
            out = func(*args, **kwargs)
            _note_resize(sanitizer, storage, before, data_ptr)
            return out
        if not (sanitizer._live and sanitizer.active):
            return func(*args, **kwargs)  # the fast path
        no_data, is_view, overwrites = self.kinds(func)
        if no_data:
            return func(*args, **kwargs)
        if is_view:
            try:
                return func(*args, **kwargs)
            except RuntimeError:  # torch's bounds check: name the release instead, if it is one
                self._check(func, args, kwargs, overwrites, reading=False)
                raise
        self._check(func, args, kwargs, overwrites, reading=True)
        out = func(*args, **kwargs)
        if not any(overwrites):  # a new output: does it reuse released memory?
            for t in pytree.tree_leaves(out):
                if checkable(t):
                    sanitizer.saw_new_memory(t)
        return out

    def _check(self, func, args, kwargs, overwrites, reading: bool) -> None:
        __tracebackhide__ = True
        try:
            self.sanitizer.check(str(func), _arguments(func, args, kwargs, overwrites),
                                 reading=reading)
        except ReleasedStorageError as error:
            args = kwargs = None  # (see StorageSanitizer.check)
            raise error from None


def _data_ptr(storage) -> int | None:
    """None for a storage without real memory (a fake tensor's, while torch.compile traces)."""
    try:
        return storage.data_ptr()
    except RuntimeError:
        return None


def _note_resize(sanitizer: StorageSanitizer, storage, before: int, data_ptr: int | None) -> None:
    if data_ptr is None:
        return
    after = storage.nbytes()
    if after < before:
        sanitizer.record(storage, before, after, data_ptr)
    elif after > before:
        sanitizer.regrown(storage)


# Tensor methods that read elements without going through the dispatcher (tolist and numpy
# read the memory in C++): guarded while the sanitizer is active. (repr is not one of them: it
# says what it cannot show instead of raising, fixes.sanitize._safe_repr.)
_DIRECT_READS = ("tolist", "numpy")


def _guarded(sanitizer: StorageSanitizer, name: str, original):
    def guarded(self, *args, **kwargs):
        if sanitizer._live and sanitizer.active and checkable(self):
            if (error := sanitizer.error_for(f"Tensor.{name}", 0, self)) is not None:
                del self, args, kwargs  # (see StorageSanitizer.check)
                raise error
        return original(self, *args, **kwargs)

    guarded.__name__ = guarded.__qualname__ = name
    return guarded


def _checked_triton_launches(sanitizer: StorageSanitizer, original):
    """``triton.runtime.jit.JITFunction.run``: a launch (``kernel[grid](...)``, also through
    triton's autotuner) reads its tensor arguments through ``data_ptr()``, which no dispatch mode
    sees; their memory is checked before the launch instead."""
    def run(kernel, *args, **kwargs):
        if sanitizer._live and sanitizer.active:
            op = f"triton kernel {getattr(kernel, '__name__', type(kernel).__name__)}"
            for index, t in enumerate((*args, *kwargs.values())):
                if checkable(t) and (error := sanitizer.error_for(op, index, t)) is not None:
                    del t, args, kwargs  # (see StorageSanitizer.check)
                    raise error
        return original(kernel, *args, **kwargs)

    return run


def _triton_patches(sanitizer: StorageSanitizer) -> list:
    # Only a triton imported already: importing it here would cost every user its import time.
    jit = sys.modules.get("triton.runtime.jit")
    cls = getattr(jit, "JITFunction", None)
    if cls is None or not callable(getattr(cls, "run", None)):
        return []
    return [(cls, "run", _checked_triton_launches(sanitizer, cls.run))]


def _checked_threads(sanitizer: StorageSanitizer, original, make_mode):
    """``threading.Thread._bootstrap_inner`` for threads started while the sanitizer is active:
    what every Thread (subclasses, pool workers) runs first on its new OS thread, so the
    thread's ops run under a mode of their own. (``threading.setprofile`` would displace a
    profiler's hook.)"""
    def _bootstrap_inner(thread):
        if not sanitizer.active:
            return original(thread)
        with make_mode():
            return original(thread)

    return _bootstrap_inner


_MISSING = object()
_slot = ActiveSlot("storage_sanitizer()")


@contextlib.contextmanager
def storage_sanitizer() -> Iterator[StorageSanitizer]:
    """While active, an op that touches a tensor whose storage was released (``resize_`` to
    fewer bytes than it needs, or grown back and not yet overwritten) or an alias of the memory
    it held raises ``ReleasedStorageError`` naming the op, its caller, the tensor and the
    release site; on the entering thread and on threads started while it is active. Not
    reentrant: entering it while it is active raises RuntimeError -- except inside a test the
    pytest plugin sanitizes, where the test's own entry joins the plugin's (a no-op)."""
    joined = _slot.joinable()
    if joined is not None:  # the pytest plugin's, entered by this thread: this entry joins it
        yield joined
        return
    here = call_site()
    sanitizer = StorageSanitizer()
    _slot.claim(sanitizer, here)
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        before, data_ptr = storage.nbytes(), _data_ptr(storage)
        result = original(storage, size)
        _note_resize(sanitizer, storage, before, data_ptr)
        return result

    kinds, resize_op = _OpKinds(), _resize_storage_bytes_op()

    def make_mode():
        return _CheckReleasedStorage(sanitizer, resize_op, kinds)

    patches = [
        (torch.UntypedStorage, "resize_", resize_),
        (threading.Thread, "_bootstrap_inner",
         _checked_threads(sanitizer, threading.Thread._bootstrap_inner, make_mode)),
    ] + [
        (torch.Tensor, name, _guarded(sanitizer, name, getattr(torch.Tensor, name)))
        for name in _DIRECT_READS
    ] + _triton_patches(sanitizer)
    saved = []
    try:
        _safe_repr.watch(sanitizer)
        for cls, name, patch in patches:
            saved.append((cls, name, patch, cls.__dict__.get(name, _MISSING)))
            setattr(cls, name, patch)
        with make_mode():
            yield sanitizer
    finally:
        sanitizer.exited()
        _safe_repr.forget_done()
        try:
            _restore(saved)
        finally:
            _slot.release()


def _restore(saved) -> None:
    replaced = []
    for cls, name, patch, own in reversed(saved):
        if cls.__dict__.get(name) is not patch:
            replaced.append(f"{cls.__name__}.{name}")
        elif own is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, own)
    if replaced:
        raise RuntimeError(f"{', '.join(replaced)} replaced while storage_sanitizer() was "
                           "active; left as found")


def _resize_storage_bytes_op():
    try:
        return torch.ops.inductor.resize_storage_bytes_.default
    except (AttributeError, RuntimeError):
        return None
