"""The recompute reclaim for megatron-core's ``CheckpointFunction.backward``: megatron's own
recompute and backward, untouched; once the backward has returned, a detached input copy that
nothing but the recompute graph holds lets go of the input's memory and of its ``.grad``.

The leak (Megatron-LM #3221 / #5197, #5227; verl #5251): with full recompute a module keeps a
recompute intermediate until its next forward. That intermediate's autograd graph ends at the
checkpoint's private detached copy of each input (its ``AccumulateGrad`` node holds the copy),
so the input's memory and the copy's ``.grad`` stay allocated after the backward. verl's
workaround ``resize_(0)``\\ s the storage of every input and grad; a storage is shared by every
view of it, so when an input is a chunk view of a tensor another node still reads, that node
reads freed memory (verl #7328: SIGSEGV on CPU, CUDA illegal memory access).

The mechanism, in one sentence: after megatron's backward has returned, each detached copy
whose only holder is its own ``AccumulateGrad`` node -- counted exactly: Python references,
weak references, the TensorImpl's C++ holders (``Tensor._use_count``: saved tensors, views'
bases, the node), post-accumulate-grad hooks -- has its ``.grad`` slot emptied and its data
pointed at a zero-stride scalar, so the leaked graph holds none of the input's memory; a copy
anyone else can reach is left exactly as megatron leaves it.

What this keeps (checkable in ``_Recompute`` and ``_let_go``):

* The recompute gets megatron's own detached leaves and the backward's result is megatron's
  own, bitwise: the reclaim changes nothing before the backward returns. autocast's cast cache,
  ``.grad`` (``retain_grad``, hooks, a backward inside the recompute), ``is_leaf``,
  ``requires_grad_()`` and the refusal of an in-place write on a leaf that requires grad (before
  it lands) are megatron's -- during the recompute and for every holder of a copy after it.
* No storage is freed or resized, and no tensor anyone can reach is changed: the input's memory
  goes by reference counting when its last real holder (the input, a view of it, a node that
  saved the copy) lets go. A copy held by anything but its node (a module caching it, a weak
  reference, a frame, a view of it, a node that saved it, a hook) is kept, readable and
  unchanged, with megatron's leak (event ``held``).
* The only way to reach a released copy is a walk of the leaked graph
  (``AccumulateGrad.variable``): it is a ``_ReleasedCopy``, whose shape, dtype, device and
  autograd flags read as before and whose values and ``.grad`` raise a ``RuntimeError`` naming
  this reclaim and ``fixes.megatron.remove_recompute_reclaim_patch()``. Every error the reclaim
  raises is that one.
* Inputs that do not require grad, tensor subclasses (DTensor, Float8Tensor) and non-strided
  layouts are left alone.

Works with any reentrant checkpoint Function whose backward recomputes through
``ctx.run_function(*detached)``: megatron-core's ``tensor_parallel.random.CheckpointFunction``
by default, and PyTorch's ``torch.utils.checkpoint.CheckpointFunction`` (``use_reentrant=True``)
for torch-only tests. It relies on nothing else of the backward's shape: whatever its function
got is examined, and only what nobody can reach is changed.

Install order: the reclaim always wraps the module's *own* backward (``fixes.megatron.pristine``).
A backward assigned by someone else before the install (verl's
``apply_patch_megatron_recomputation_backward`` does, in its engine's init) is replaced with a
``RuntimeWarning`` naming it; one assigned *after* the install is named by a ``RuntimeWarning``
at the next checkpoint call (the reclaim also wraps ``CheckpointFunction.forward`` to see it),
and ``installed_reclaim()`` reports what is installed *now*.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fixes.megatron.backward_patch import (
    install_backward_wrapper,
    installed_reclaim,
    reset_backward,
    uninstall_backward_wrapper,
)
from fixes.megatron.reclaim_events import (
    ReclaimAction,
    ReclaimEvent,
    emit,
    recompute_reclaim_events,
    storage_of,
)
from fixes.megatron.reclaim_events import _observers as _observers

__all__ = [
    "PATCH_KIND",
    "ReclaimAction",
    "ReclaimEvent",
    "apply_recompute_reclaim_patch",
    "installed_reclaim",
    "recompute_reclaim_events",
    "remove_recompute_reclaim_patch",
    "reset_backward",
]

PATCH_KIND = "release-unheld"
WAY_OUT = "fixes.megatron.remove_recompute_reclaim_patch()"


# --- a released copy ------------------------------------------------------------------------

# What a walk of a leaked graph may still read of a released copy: what letting go did not
# change. Everything else (values, strides, storage, .grad, pickling, deepcopy) raises.
_METADATA = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad_fn",
    "output_nr", "_version", "_base", "is_cuda", "is_cpu", "is_meta", "is_sparse",
    "is_quantized", "is_nested", "size", "dim", "numel", "element_size", "get_device",
    "is_floating_point", "is_complex", "requires_grad_",
})


class _ReleasedCopy(torch.Tensor):
    """A checkpoint's detached input copy the reclaim let go of: nothing but its own
    ``AccumulateGrad`` node (in a leaked recompute graph) held it. Its data is a zero-stride
    scalar, its ``.grad`` slot empty; reading either raises instead of answering."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in ("__get__", "__set__", "__delete__"):  # a property of the tensor
            name = getattr(getattr(func, "__self__", None), "__name__", None)
            allowed = name in _METADATA or func.__name__ != "__get__"
        else:
            allowed = name in _METADATA or func is torch.Tensor.__hash__
        if allowed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"{name} of a checkpoint input copy released by stackfix's recompute reclaim: once "
            "megatron's backward had returned, nothing but the leaked recompute graph held this "
            "detached copy, so the reclaim let go of the input's memory and its .grad (the "
            "Megatron-LM #3221 leak); a walk of that graph finds the copy without its values. "
            f"Call {WAY_OUT} (or do not apply it) to walk megatron's own graph.")

    def __repr__(self) -> str:
        return (f"<checkpoint input copy released by stackfix's recompute reclaim: "
                f"shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}>")


_SCALARS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _nothing_like(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape, dtype and device on one shared element: no memory of the input. (Shape
    and dtype are kept: a later backward through the leaked graph still accumulates into the
    copy, and AccumulateGrad reads its sizes and strides.)"""
    key = (t.dtype, t.device)
    scalar = _SCALARS.get(key)
    if scalar is None:
        scalar = _SCALARS.setdefault(key, torch.zeros((), dtype=t.dtype, device=t.device))
    return scalar.expand(t.shape)


def _prepare_scalars() -> None:
    """The elements released copies point at, made at install time for the float dtypes on the
    CPU and, if CUDA is already initialized (never initialized here), its current device: the
    reclaim then allocates nothing during training (one element per other dtype or device)."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    for device in devices:
        for dtype in _FLOATS:
            _SCALARS.setdefault((dtype, device), torch.zeros((), dtype=dtype, device=device))


# --- who holds a copy ------------------------------------------------------------------------


def _holders(args: tuple, i: int) -> tuple[int, int, int]:
    """Python references, weak references and TensorImpl holders of ``args[i]``, ours included:
    compare with ``_UNHELD``, measured through this same function."""
    t = args[i]
    return sys.getrefcount(t), weakref.getweakrefcount(t), t._use_count()


def _measure_unheld() -> dict[int, int]:
    """TensorImpl holders -> Python references, of a leaf only ``args`` holds (1: its Python
    object) and of one only ``args`` and its own AccumulateGrad node hold. (PyTorch 2.13 holds
    one more reference to the Python object while C++ holds the tensor: measured, not assumed.)"""
    args = (torch.zeros((), requires_grad=True),)
    alone, _, one = _holders(args, 0)
    edge = torch.autograd.graph.get_gradient_edge(args[0])  # holds the node, the node the leaf
    with_node, _, two = _holders(args, 0)
    del edge
    return {one: alone, two: with_node}


_UNHELD = _measure_unheld()
_ALONE, _WITH_NODE = sorted(_UNHELD)


def _let_go(args: tuple, i: int) -> ReclaimAction:
    """Release ``args[i]`` (a detached copy the recompute got) if nothing but its own
    AccumulateGrad node holds it; ``held`` otherwise, and then it is left untouched."""
    python, weak, impl = _holders(args, i)
    t = args[i]
    if (_UNHELD.get(impl) != python or weak
            or getattr(t, "_post_accumulate_grad_hooks", None)):
        return ReclaimAction.HELD  # a holder we cannot name, a weak reference, a hook that gets it
    if impl == _ALONE:
        return ReclaimAction.RELEASED  # nothing else holds it: it goes with ``args``
    if not t.requires_grad:
        return ReclaimAction.HELD
    # One C++ holder besides its Python object: its own AccumulateGrad node, or another (a
    # custom Function that saved it without an edge to it)? The node exists iff asking for it
    # adds no holder.
    edge = torch.autograd.graph.get_gradient_edge(t)
    own_node = t._use_count() == impl
    del edge
    if not own_node:
        return ReclaimAction.HELD
    t.grad = None
    # The reclaim's own bookkeeping, not the model's: no tensor dispatch mode a tool runs
    # (a memory tracker, say) sees it.
    with _disable_current_modes():
        t.data = _nothing_like(t)
    t.__class__ = _ReleasedCopy
    return ReclaimAction.RELEASED


# --- the recompute ---------------------------------------------------------------------------


def _examined(arg: object) -> bool:
    return (type(arg) is torch.Tensor and arg.requires_grad and arg.layout is torch.strided)


class _Recompute:
    """``ctx.run_function`` for the duration of one checkpoint backward: calls it with exactly
    what megatron passes, and remembers those arguments for ``let_go``."""

    __slots__ = ("run_function", "calls")

    def __init__(self, run_function: Callable) -> None:
        self.run_function = run_function
        self.calls: list[tuple] = []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.run_function(*args, **kwargs)

    def let_go(self) -> None:
        """After the backward returned: release every copy only its AccumulateGrad holds."""
        calls, self.calls = self.calls, []
        if not calls:
            emit(ReclaimAction.UNOBSERVED, "checkpoint")
            return
        for args in calls:
            for i in range(len(args)):
                if not isinstance(args[i], torch.Tensor) or not args[i].requires_grad:
                    continue
                if not _examined(args[i]):
                    if _observers:
                        emit(ReclaimAction.PASSED, "input", *storage_of(args[i]))
                    continue
                storage = storage_of(args[i]) if _observers else (0, 0)
                action = _let_go(args, i)
                if _observers:
                    emit(action, "input", *storage)


def _reclaiming(backward: Callable) -> Callable:
    @functools.wraps(backward)
    def reclaiming_backward(ctx, *grad_outputs):
        recompute = _Recompute(ctx.run_function)
        ctx.run_function = recompute
        try:
            result = backward(ctx, *grad_outputs)
        except BaseException:
            recompute.calls.clear()
            raise
        finally:
            ctx.run_function = recompute.run_function
        recompute.let_go()
        return result

    return reclaiming_backward


def apply_recompute_reclaim_patch(target: type | None = None) -> bool:
    """Install the reclaim on megatron-core's ``CheckpointFunction.backward`` (or on ``target``,
    a reentrant checkpoint Function of the same shape), around the module's own backward; a
    foreign backward (verl's reclaim) is replaced, with a warning. Returns False when it was
    already installed."""
    _prepare_scalars()
    return install_backward_wrapper(PATCH_KIND, _reclaiming, target)


def remove_recompute_reclaim_patch(target: type | None = None) -> bool:
    """Restore the module's own backward. False when the reclaim was not what was installed."""
    return uninstall_backward_wrapper(PATCH_KIND, target)
