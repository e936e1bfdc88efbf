"""State captured per checkpointed region: its recompute starts from the state its forward
started from, and leaves the state as it found it.

Why: a recompute re-runs forward code inside ``backward()``, after every later layer's forward.
State outside the region's inputs has moved on by then:

* Megatron-LM #6793: layers that share DSA top-k indices keep them in one holder; the next
  computing layer's (checkpointed) forward overwrites it, so an earlier sharing layer's
  recompute reads another layer's indices -- silently wrong gradients.
* torchtitan #4568 / #4673: a counter or buffer updated inside a checkpointed region (e.g. MoE
  tokens-per-expert) is updated again by the recompute.

A target is ``(obj, "attr")``. When the region's forward starts, each target's value is kept
(a tensor also as a copy of its elements). Around each recompute: the kept value is put back
on the attribute (a tensor mutated in place since is given its kept elements back), the
recompute runs, and then the values found before the recompute are restored (rebound, or their
elements copied back if the recompute mutated them in place). Tensors are copied only when
their version counter says they were mutated, so a tensor another node saved for backward is
not written. While a recompute runs, the storages of its targets' tensors are listed by
``managed_storages()``: ``fixes.sanitize.recompute_sanitizer`` does not report writes to them
as replayed side effects.

``state_preserving_context_fn`` is a ``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant);
``state_preserving`` wraps the region's function for any checkpoint that calls it once for the
forward and again for each recompute (megatron-core's ``tensor_parallel.checkpoint``, reentrant
``torch.utils.checkpoint``). Both make one ``RecomputeState`` per checkpoint call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["RecomputeState", "managed_storages", "state_preserving", "state_preserving_context_fn"]

_MISSING = object()
_local = threading.local()


def managed_storages() -> frozenset[int]:
    """Storage keys (``untyped_storage()._cdata``) of the tensors whose state the recomputes
    running on this thread replay from a snapshot."""
    return frozenset(getattr(_local, "managed", ()))


class _Value:
    """One attribute's value, with its elements and version counter if it is a tensor."""

    __slots__ = ("obj", "copy", "version")

    def __init__(self, obj):
        self.obj = obj
        self.copy = self.version = None
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                self.copy = obj.detach().clone()
            self.version = obj._version

    def install(self, owner, name: str) -> None:
        if self.obj is _MISSING:
            if hasattr(owner, name):
                delattr(owner, name)
            return
        if getattr(owner, name, _MISSING) is not self.obj:
            setattr(owner, name, self.obj)
        if self.copy is not None and self.obj._version != self.version:
            with torch.no_grad():
                self.obj.copy_(self.copy)
            self.version = self.obj._version


def _storage_key(value) -> int | None:
    if isinstance(value, torch.Tensor) and value.layout is torch.strided and not value.is_meta:
        return value.untyped_storage()._cdata
    return None


class RecomputeState:
    """The targets' state for one checkpointed region: ``forward()`` around its forward (the
    snapshot is taken on entry), ``recompute()`` around each recompute."""

    def __init__(self, *targets: tuple[object, str]):
        for target in targets:
            if not (isinstance(target, tuple) and len(target) == 2 and isinstance(target[1], str)):
                raise TypeError(f"a target is (object, 'attribute name'); got {target!r}")
        self.targets = targets
        self._snapshot: list[_Value] | None = None

    def _read(self) -> list[_Value]:
        return [_Value(getattr(owner, name, _MISSING)) for owner, name in self.targets]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._snapshot = self._read()
        yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        if self._snapshot is None:
            raise RuntimeError("RecomputeState.recompute() before its forward(): nothing was "
                               "captured for this region")
        keys = [k for v in self._snapshot if (k := _storage_key(v.obj)) is not None]
        found = self._read()
        keys += [k for v in found if (k := _storage_key(v.obj)) is not None]
        managed = _local.__dict__.setdefault("managed", [])
        managed.extend(keys)
        try:
            for value, (owner, name) in zip(self._snapshot, self.targets, strict=True):
                value.install(owner, name)
            yield
        finally:
            try:
                for value, (owner, name) in zip(found, self.targets, strict=True):
                    value.install(owner, name)
            finally:
                for key in keys:
                    managed.remove(key)


def state_preserving_context_fn(*targets: tuple[object, str],
                                context_fn: Callable | None = None) -> Callable:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that captures ``targets`` per region (see the module docstring), around the contexts of
    ``context_fn`` (another context_fn, e.g. a selective-AC policy's) when given."""

    def make_contexts():
        state = RecomputeState(*targets)
        inner_forward, inner_recompute = (context_fn() if context_fn is not None
                                          else (contextlib.nullcontext(), contextlib.nullcontext()))
        return _both(state.forward(), inner_forward), _both(state.recompute(), inner_recompute)

    return make_contexts


@contextlib.contextmanager
def _both(outer, inner) -> Iterator[None]:
    with outer, inner:
        yield


def state_preserving(fn: Callable, *targets: tuple[object, str]) -> Callable:
    """``fn`` for one checkpoint call: its first call is the region's forward (``targets``
    captured on entry), every later call a recompute of it. Make a new one per checkpoint
    call (a wrapper reused across steps would take the next step's forward for a recompute)."""
    state = RecomputeState(*targets)
    calls = 0

    @functools.wraps(fn)
    def region(*args, **kwargs):
        nonlocal calls
        calls += 1
        with state.forward() if calls == 1 else state.recompute():
            return fn(*args, **kwargs)

    return region
