"""``repr`` of a tensor that lies in memory a ``storage_sanitizer()`` saw released says so
instead of reading it: while the sanitizer is active, and after it has exited for as long as
that storage lives (shrunk, or aliased by another StorageImpl).

Why after: a ``ReleasedStorageError`` is printed once it has left the ``with`` block, and its
traceback keeps the frames that held the released tensor. pytest's long traceback shows each
frame's arguments (``forward(self, x)``: ``x = ...``), ``-l`` / ``--showlocals`` its locals,
``traceback.TracebackException(capture_locals=True)`` the same: each calls ``repr``, which would
read the freed memory (SIGSEGV on CPU) and take the report of the error down with it.

How: ``torch.Tensor.__repr__`` is wrapped when a sanitizer is entered and asks each sanitizer
still watched (``StorageSanitizer.error_for``, the check the ops get) before torch's repr runs.
A sanitizer stays watched after its exit while it tracks a live released storage; once none is
left (none was released: at its exit; the storages died since: at the next repr), torch's own
``__repr__`` is put back.
"""

from __future__ import annotations

import threading

import torch

from fixes.sanitize._released import StorageSanitizer, checkable

_watched: list[StorageSanitizer] = []  # active, or exited and tracking a live release
_lock = threading.Lock()
_original = torch.Tensor.__dict__["__repr__"]  # what the wrapper forwards to (set on install)
_installed = False


def watch(sanitizer: StorageSanitizer) -> None:
    """From the sanitizer's entry on: reprs of tensors in the memory it saw released are safe."""
    global _original, _installed
    with _lock:
        if not _installed:
            _original, _installed = torch.Tensor.__dict__["__repr__"], True
            torch.Tensor.__repr__ = __repr__
        _watched.append(sanitizer)


def forget_done() -> None:
    """Stop watching exited sanitizers that track no live release; torch's repr is put back
    when none is watched (unless something wrapped it meanwhile: the wrapper then forwards)."""
    global _installed
    with _lock:
        _watched[:] = [s for s in _watched if s.active or s._live]
        if not _watched and _installed and torch.Tensor.__dict__.get("__repr__") is __repr__:
            torch.Tensor.__repr__, _installed = _original, False


def __repr__(self, *args, **kwargs):
    if _watched and checkable(self):
        for sanitizer in tuple(_watched):
            if sanitizer._live and sanitizer.error_for("Tensor.__repr__", 0, self) is not None:
                return (f"tensor(<released storage>, size={tuple(self.shape)}, "
                        f"dtype={self.dtype}, device='{self.device}')")
        forget_done()  # e.g. the last released storage died since the sanitizer exited
    return _original(self, *args, **kwargs)
