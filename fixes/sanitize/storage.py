"""``storage_sanitizer()``: an op that would read or write memory given back by
``UntypedStorage.resize_`` raises ``ReleasedStorageError`` before its kernel runs.

Why: verl's recompute reclaim (verl #5251, #7328) ``resize_(0)``\\ s storages that chunk views
share; the later reader dies with SIGSEGV on CPU or a CUDA illegal memory access, far from the
release, or reads garbage once the storage is grown again. Nothing in PyTorch names the culprit.

How, while active: ``torch.UntypedStorage.resize_`` is wrapped to record every shrink with its
Python call site, and a ``TorchDispatchMode`` checks the tensor arguments of every op against the
shrunk storages that are still alive. The autograd engine runs backward ops under the modes of
the thread that called ``backward()``, also on its device threads. Until a shrink is recorded (and
again once every shrunk storage is gone) the mode only forwards each op: the fast path. The
reads that bypass the dispatcher (``repr``, ``tolist``, ``numpy``) are guarded the same way.

Not seen: ops on threads other than the one that entered (and autograd's workers for its
backward passes), ops inside torch.compile'd regions, shrinks made from C++, C++ extensions that
read ``data_ptr()`` directly, and reads of a storage that was shrunk and grown back (memory-safe,
but the bytes are uninitialised).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from fixes.sanitize._callsite import ActiveSlot, call_site, describe_site

__all__ = ["ReleasedStorageError", "StorageRelease", "StorageSanitizer", "storage_sanitizer"]


@dataclass(frozen=True, slots=True)
class StorageRelease:
    """One shrink of a storage, and where it happened (innermost frame first)."""

    storage: int  # StorageImpl address, as fixes.megatron.storage.storage_key gives it
    nbytes_before: int
    nbytes_after: int
    site: tuple[str, ...]
    thread: str

    def describe(self) -> str:
        return (f"resize_({self.nbytes_after}) ({self.nbytes_before} -> {self.nbytes_after} bytes) "
                f"at {describe_site(self.site)} [thread {self.thread}]")


class ReleasedStorageError(RuntimeError):
    """An op was about to touch a tensor whose storage was released (shrunk) under it."""

    def __init__(self, op: str, index: int, tensor: torch.Tensor, needed: int, nbytes: int,
                 release: StorageRelease):
        self.op, self.release = op, release
        self.shape = tuple(tensor.shape)
        super().__init__(
            f"{op} would access freed memory: its tensor argument #{index} "
            f"(shape {list(self.shape)}, {tensor.dtype}, {tensor.device}) needs {needed} bytes of "
            f"a storage that now holds {nbytes}; the storage was released by "
            f"UntypedStorage.{release.describe()}"
        )


# Ops that touch no element of their tensor arguments (views and metadata-only factories are
# found by ``OpOverload.is_view`` on top of this list).
_NO_DATA_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("detach", "alias", "set_", "resize_", "record_stream", "empty_like", "new_empty",
                 "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
                 "new_ones", "new_full", "rand_like", "randn_like", "randint_like",
                 "is_same_size", "_has_same_storage_numel", "sym_size", "sym_stride",
                 "sym_numel", "sym_storage_offset")
    if hasattr(torch.ops.aten, name)
)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _needed_bytes(t: torch.Tensor) -> int:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + extent) * t.element_size()


def _checkable(t) -> bool:
    return (isinstance(t, torch.Tensor) and type(t) in _PLAIN and t.layout is torch.strided
            and not t.is_meta and not t.is_nested and t.numel() > 0)


class StorageSanitizer:
    """What ``storage_sanitizer()`` yields: ``releases`` lists every shrink recorded so far."""

    def __init__(self) -> None:
        self.releases: list[StorageRelease] = []
        # Shrunk storages still alive: address -> (weak reference, release). PyTorch keeps one
        # Python object per live StorageImpl, so the weak reference dies with the storage itself
        # (and the address cannot be reused while the entry is here). Strong references would
        # change the storage use counts that fixes.megatron.is_storage_exclusive reads.
        self._live: dict[int, tuple[weakref.ref, StorageRelease]] = {}
        self._lock = threading.Lock()
        self._data_ops: dict = {}

    def record(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        key = storage._cdata
        release = StorageRelease(key, before, after, call_site(),
                                 threading.current_thread().name)

        def gone(ref, key=key):
            with self._lock:
                if self._live.get(key, (None,))[0] is ref:
                    del self._live[key]

        with self._lock:
            self.releases.append(release)
            self._live[key] = (weakref.ref(storage, gone), release)

    def regrown(self, storage: torch.UntypedStorage) -> None:
        """Grown back to its size before the release: memory-safe again, no longer tracked."""
        with self._lock:
            entry = self._live.get(storage._cdata)
            if entry is not None and storage.nbytes() >= entry[1].nbytes_before:
                del self._live[storage._cdata]

    def reads_data(self, func) -> bool:
        known = self._data_ops.get(func)
        if known is None:
            known = self._data_ops[func] = not (func.is_view or func.overloadpacket in _NO_DATA_OPS)
        return known

    def check(self, func, args, kwargs) -> None:
        """Raise if one of the op's tensor arguments lies (partly) in released memory."""
        __tracebackhide__ = True  # pytest: the error names everything; show the caller's frames
        for index, t in enumerate(pytree.tree_leaves((args, kwargs))):
            if _checkable(t) and (error := self._released(str(func), index, t)) is not None:
                # A traceback printer that shows frame arguments or locals (pytest does) must not
                # reach the released tensor through these frames.
                del t, args, kwargs
                raise error

    def _released(self, op: str, index: int, t: torch.Tensor) -> ReleasedStorageError | None:
        storage = t.untyped_storage()
        entry = self._live.get(storage._cdata)
        if entry is None:
            return None
        needed, nbytes = _needed_bytes(t), storage.nbytes()
        if nbytes >= needed:
            return None
        return ReleasedStorageError(op, index, t, needed, nbytes, entry[1])


class _CheckReleasedStorage(TorchDispatchMode):
    def __init__(self, sanitizer: StorageSanitizer, resize_storage_bytes) -> None:
        super().__init__()
        self.sanitizer = sanitizer
        self.resize_storage_bytes = resize_storage_bytes  # torch.compile / FSDP2's resize op

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Otherwise torch.compile refuses to compile under a user mode (and fullgraph=True
        # fails); compiled regions run unchecked, their eager callers stay checked.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True
        kwargs = kwargs or {}
        for t in types:
            if t not in _PLAIN:
                if is_traceable_wrapper_subclass_type(t):  # DTensor & co: let it unwrap first;
                    return NotImplemented  # this mode then sees the ops on its inner tensors
                return func(*args, **kwargs)  # FakeTensor, FunctionalTensor: no real storage
        if func is self.resize_storage_bytes:
            storage = args[0].untyped_storage()
            before = storage.nbytes()
            out = func(*args, **kwargs)
            _note_resize(self.sanitizer, storage, before)
            return out
        if self.sanitizer._live and self.sanitizer.reads_data(func):
            try:
                self.sanitizer.check(func, args, kwargs)
            except ReleasedStorageError:
                args = kwargs = None  # (see check)
                raise
        return func(*args, **kwargs)


def _note_resize(sanitizer: StorageSanitizer, storage, before: int) -> None:
    after = storage.nbytes()
    if after < before:
        sanitizer.record(storage, before, after)
    elif after > before:
        sanitizer.regrown(storage)


# Tensor methods that read elements without going through the dispatcher (a repr turns all
# modes off; tolist and numpy read the memory in C++): guarded while the sanitizer is active.
_DIRECT_READS = ("__repr__", "tolist", "numpy")


def _guarded(sanitizer: StorageSanitizer, name: str, original):
    def guarded(self, *args, **kwargs):
        if sanitizer._live and _checkable(self):
            if (error := sanitizer._released(f"Tensor.{name}", 0, self)) is not None:
                del self, args, kwargs  # (see StorageSanitizer.check)
                raise error
        return original(self, *args, **kwargs)

    guarded.__name__ = guarded.__qualname__ = name
    return guarded


_MISSING = object()
_slot = ActiveSlot("storage_sanitizer()")


@contextlib.contextmanager
def storage_sanitizer() -> Iterator[StorageSanitizer]:
    """While active, an op that touches a tensor whose storage was released (``resize_`` to
    fewer bytes than it needs) raises ``ReleasedStorageError`` naming the op, the tensor and
    the release site. Not reentrant: entering it while it is active raises RuntimeError."""
    here = call_site()
    sanitizer = StorageSanitizer()
    _slot.claim(sanitizer, here)
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        before = storage.nbytes()
        result = original(storage, size)
        _note_resize(sanitizer, storage, before)
        return result

    patches = [(torch.UntypedStorage, "resize_", resize_)] + [
        (torch.Tensor, name, _guarded(sanitizer, name, getattr(torch.Tensor, name)))
        for name in _DIRECT_READS
    ]
    saved = []
    try:
        for cls, name, patch in patches:
            saved.append((cls, name, patch, cls.__dict__.get(name, _MISSING)))
            setattr(cls, name, patch)
        with _CheckReleasedStorage(sanitizer, _resize_storage_bytes_op()):
            yield sanitizer
    finally:
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
