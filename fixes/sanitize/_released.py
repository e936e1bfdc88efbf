"""What ``storage_sanitizer()`` knows about released storages, and the one check it makes: does
a tensor lie (partly) in memory that ``UntypedStorage.resize_`` gave back?

A released storage is tracked while it is alive, by two keys:

* its StorageImpl: a tensor on it that needs more bytes than the storage now holds reads freed
  memory; once it has grown back to its old size, its bytes are uninitialised until an op
  overwrites them (``copy_``, ``zero_``, ``fill_``, an ``out=`` argument): until then a read is
  an error too;
* the data pointer range it held before the release: another StorageImpl over that memory (a
  ``from_dlpack`` or ``frombuffer`` alias: such storages are not resizable, they do not own
  their memory) dangles. Once an op's output is seen in that range (the allocator reused it),
  aliases there are no longer flagged: they then read live memory of another tensor.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from fixes.sanitize._callsite import call_site, describe_site


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


# Why a tensor's memory is not safe to touch (the second line of the error).
_WHY = {
    "released": "needs {needed} bytes of a storage that now holds {nbytes}",
    "regrown": ("lies in a storage regrown after its release: its bytes are uninitialised until "
                "an op overwrites them"),
    "alias": ("is another StorageImpl's view (from_dlpack, frombuffer) of the memory a storage "
              "held before its release"),
}


class ReleasedStorageError(RuntimeError):
    """An op was about to touch a tensor whose storage was released (shrunk) under it.

    The message's first line names the op, its Python caller (``caller``: innermost first,
    torch's and the sanitizers' frames skipped) and the release site (``release``)."""

    def __init__(self, op: str, index: int, tensor: torch.Tensor, release: StorageRelease, *,
                 kind: str = "released", needed: int = 0, nbytes: int = 0,
                 caller: tuple[str, ...] = ()):
        self.op, self.release, self.kind, self.caller = op, release, kind, caller
        self.shape = tuple(tensor.shape)
        where = caller[0] if caller else "(no Python caller outside torch)"
        released_at = release.site[0] if release.site else "(no Python caller outside torch)"
        # For one-line reports (pytest's short summary): file:line only.
        self.summary = (f"ReleasedStorageError: {op} at {where.split(' in ')[0]}, "
                        f"released at {released_at.split(' in ')[0]}")
        super().__init__(
            f"{op} at {where} would access freed memory (released at {released_at})\n"
            f"  its tensor argument #{index} (shape {list(self.shape)}, {tensor.dtype}, "
            f"{tensor.device}) " + _WHY[kind].format(needed=needed, nbytes=nbytes) + "\n"
            f"  the storage was released by UntypedStorage.{release.describe()}\n"
            f"  the op was called from {describe_site(caller)}"
        )


ReleasedStorageError.__module__ = "fixes.sanitize"  # its public home; shorter in tracebacks

PLAIN = (torch.Tensor, torch.nn.Parameter)
# Ops that overwrite their ``self`` without reading it; any argument named ``out*`` (``out=``,
# c10d's ``output_tensor``) is overwritten too. Only these make a regrown storage readable.
OVERWRITE_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("copy_", "zero_", "fill_", "normal_", "uniform_", "random_", "bernoulli_",
                 "exponential_", "geometric_", "cauchy_", "log_normal_")
    if hasattr(torch.ops.aten, name)
)


def needed_bytes(t: torch.Tensor) -> int:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + extent) * t.element_size()


def checkable(t) -> bool:
    return (isinstance(t, torch.Tensor) and type(t) in PLAIN and t.layout is torch.strided
            and not t.is_meta and not t.is_nested and t.numel() > 0)


@dataclass(slots=True)
class _Entry:
    ref: weakref.ref
    release: StorageRelease
    device: torch.device
    start: int  # the data pointer range the storage held before the release
    end: int
    regrown: bool = False  # grown back to its size: uninitialised until overwritten
    reused: bool = False  # an op's output was seen in [start, end): aliases no longer flagged


class StorageSanitizer:
    """What ``storage_sanitizer()`` yields: ``releases`` lists every shrink recorded so far."""

    def __init__(self) -> None:
        self.releases: list[StorageRelease] = []
        self.active = True  # False once the context has exited (threads it reached stop checking)
        # Released storages still alive, by StorageImpl address. PyTorch keeps one Python object
        # per live StorageImpl, so the weak reference dies with the storage itself (and the
        # address cannot be reused while the entry is here). Strong references would change the
        # storage use counts that fixes.megatron.is_storage_exclusive reads.
        self._live: dict[int, _Entry] = {}
        self._lock = threading.Lock()

    def record(self, storage: torch.UntypedStorage, before: int, after: int,
               data_ptr: int) -> None:
        """``storage`` shrank from ``before`` to ``after`` bytes; it held ``data_ptr``."""
        key = storage._cdata
        release = StorageRelease(key, before, after, call_site(), threading.current_thread().name)

        def gone(ref, key=key):
            with self._lock:
                entry = self._live.get(key)
                if entry is not None and entry.ref is ref:
                    del self._live[key]

        entry = _Entry(weakref.ref(storage, gone), release, storage.device, data_ptr,
                       data_ptr + before)
        with self._lock:
            self.releases.append(release)
            self._live[key] = entry

    def exited(self) -> None:
        """The context has exited: no op is checked from now on. A regrown storage is no longer
        tracked (its memory is safe to read, and what writes it from now on is not seen); a
        shrunk one is while it lives, for ``repr`` (fixes.sanitize._safe_repr)."""
        self.active = False
        with self._lock:
            for key in [key for key, entry in self._live.items() if entry.regrown]:
                del self._live[key]

    def regrown(self, storage: torch.UntypedStorage) -> None:
        """Grown back to its size before the release: memory-safe, but uninitialised."""
        entry = self._live.get(storage._cdata)
        if entry is not None and storage.nbytes() >= entry.release.nbytes_before:
            entry.regrown = True

    def check(self, op: str, arguments, *, reading: bool = True) -> None:
        """Raise ReleasedStorageError if a tensor in ``arguments`` (pairs of: is it overwritten
        by the op, its value) lies in released memory. ``reading`` False: only the bytes a
        storage no longer holds count (a view op reads none)."""
        __tracebackhide__ = True  # pytest: the error names everything; show the caller's frames
        index = 0
        for overwritten, value in arguments:
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(t, torch.Tensor):
                    continue
                if checkable(t):
                    error = self.error_for(op, index, t, overwritten=overwritten,
                                           reading=reading)
                    if error is not None:
                        # A traceback printer that shows frame locals (pytest does) must not
                        # reach the released tensor through these frames.
                        del t, value, arguments
                        raise error
                index += 1

    def error_for(self, op: str, index: int, t: torch.Tensor, *, overwritten: bool = False,
                  reading: bool = True) -> ReleasedStorageError | None:
        storage = t.untyped_storage()
        entry = self._live.get(storage._cdata)
        if entry is not None:
            needed, nbytes = needed_bytes(t), storage.nbytes()
            if nbytes < needed:
                return self._error(op, index, t, entry, "released", needed, nbytes)
            if entry.regrown and reading:
                if not overwritten:
                    return self._error(op, index, t, entry, "regrown")
                with self._lock:  # written in full: readable from now on
                    if self._live.get(storage._cdata) is entry:
                        del self._live[storage._cdata]
            return None
        if reading and not storage.resizable():
            start = t.data_ptr()
            end = start + needed_bytes(t) - t.storage_offset() * t.element_size()
            for entry in list(self._live.values()):
                if (not entry.reused and entry.start < end and start < entry.end
                        and entry.device == storage.device):
                    return self._error(op, index, t, entry, "alias")
        return None

    def saw_new_memory(self, t: torch.Tensor) -> None:
        """``t`` is an op's new output: if it lies in a released range, the allocator has
        reused that memory, and aliases into it are no longer told apart from its own."""
        storage = t.untyped_storage()
        if storage._cdata in self._live or not storage.resizable():
            return
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for entry in list(self._live.values()):
            if entry.start < end and start < entry.end and entry.device == storage.device:
                entry.reused = True

    def _error(self, op, index, t, entry, kind, needed=0, nbytes=0) -> ReleasedStorageError:
        return ReleasedStorageError(op, index, t, entry.release, kind=kind, needed=needed,
                                    nbytes=nbytes, caller=call_site())
