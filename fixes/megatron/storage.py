"""Who else holds a tensor's memory? ``is_storage_exclusive`` answers it for users auditing a
``resize_(0)`` (the reclaim itself frees no storage; it counts the holders of its own detached
copies, ``fixes.megatron.reclaim``).

Why it matters: verl's recompute reclaim (verl #5251, the workaround for Megatron-LM #3221)
calls ``untyped_storage().resize_(0)`` on every checkpoint input. ``resize_(0)`` frees the
*storage*, so every tensor sharing it loses its memory: views, ``torch.chunk`` pieces, and the
``.data`` aliases that megatron's ``make_viewless_tensor`` builds (``_base`` is None, the storage
is still shared, so a ``_base``-based test misses it). When one of those belongs to an autograd
node whose backward has not run yet, that node reads freed memory (verl #7328: SIGSEGV on CPU,
CUDA illegal memory access on GPU).

How, at two levels:

* Storage level: every ``TensorImpl`` that uses a storage holds one reference to its
  ``StorageImpl``; ``torch._C._storage_Use_Count`` reads that count. Views, chunks, narrow /
  slice / transpose / expand / as_strided, ``.detach()`` and ``.data`` aliases are all separate
  TensorImpls, so each adds one. A view's hidden ``_base`` adds one too. Anything beyond the
  TensorImpls the caller names is a foreign holder.
* TensorImpl level: the storage count cannot see one TensorImpl held by several owners — e.g.
  the same hidden-states tensor saved by two checkpoints, or a leaf referenced by its
  ``AccumulateGrad`` node: the storage count stays 1. ``Tensor._use_count()`` reads the
  TensorImpl's own reference count: the Python object holds one, and every C++ holder (an
  autograd ``SavedVariable`` of an input, an ``AccumulateGrad`` node, a view's base pointer)
  one more. ``sys.getrefcount`` would only see Python references and misses all of these.

What no count sees: a weak reference, or a reader that will read through a Python object it
can still reach later. A "no" is always safe; a "yes" says only that no *tensor* shares it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["is_storage_exclusive", "storage_key"]

# ``Tensor._use_count`` (the TensorImpl's reference count): without it no holder can be counted,
# so no storage is inspectable and every answer is the safe one.
COUNTS_TENSOR_HOLDERS = hasattr(torch.Tensor, "_use_count")


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (its StorageImpl address)."""
    return tensor.untyped_storage()._cdata


def _has_inspectable_storage(tensor: torch.Tensor) -> bool:
    # Wrapper subclasses (DTensor, FakeTensor, functional tensors) and sparse layouts have no
    # storage of their own that these counts describe; callers treat them as shared.
    if not COUNTS_TENSOR_HOLDERS or tensor.layout is not torch.strided:
        return False
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def is_storage_exclusive(
    tensor: torch.Tensor, owners: Iterable[torch.Tensor] = (), *, saved_refs: int = 0
) -> bool:
    """True only when no live tensor other than ``tensor`` and ``owners`` shares its storage.

    * Every other TensorImpl using the storage counts as sharing: views, ``torch.chunk``
      pieces, narrow / slice / transpose / expand / as_strided results, a view's ``_base``, and
      ``.data`` / ``.detach()`` aliases whose ``_base`` is None.
    * ``tensor`` itself must not be held by anyone but its Python object: an autograd node that
      saved it, its ``AccumulateGrad`` node (leaves that require grad), or a view's base pointer
      are readers the storage count cannot see. ``saved_refs`` is the number of such C++ holders
      the caller accounts for (a checkpoint's own saved slot, say).
    * ``owners`` are tensors whose holders are the caller's own (e.g. a checkpoint's private
      detached copies): they may share the storage and nobody's references to them count.
      Owners on another storage are ignored.

    False is always safe; it is also the answer for tensors whose storage cannot be inspected
    (sparse, wrapper subclasses such as DTensor / FakeTensor).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    owners = tuple(owners)
    for o in owners:
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"owners must be torch.Tensors, got {type(o).__name__}")
    if not isinstance(saved_refs, int) or saved_refs < 0:
        raise ValueError(f"saved_refs must be an int >= 0, got {saved_refs!r}")
    if not _has_inspectable_storage(tensor):
        return False

    storage = tensor.untyped_storage()  # our one temporary reference to the StorageImpl
    key = storage._cdata
    impls = {tensor._cdata}
    # An owner that is a view of `tensor` holds it through its base pointer: an owned holder.
    owned_views = 0
    for o in owners:
        if _has_inspectable_storage(o) and o.untyped_storage()._cdata == key:
            impls.add(o._cdata)
            base = o._base
            owned_views += base is not None and base._cdata == tensor._cdata
    # Each TensorImpl holds exactly one reference; `storage` (ours) one more.
    holders = torch._C._storage_Use_Count(key) - 1
    if holders > len(impls):
        return False
    # The Python object we were handed owns one reference to the TensorImpl.
    return tensor._use_count() - 1 <= saved_refs + owned_views
