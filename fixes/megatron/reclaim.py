"""The recompute reclaim for megatron-core's ``CheckpointFunction.backward``: the recompute
graph holds no reference to the checkpoint's inputs, so nothing needs to be freed.

The leak (Megatron-LM #3221 / #5197, #5227; verl #5251): with full recompute a module keeps a
recompute intermediate until its next forward. That intermediate's autograd graph ends at the
checkpoint's private detached copy of each input (its ``AccumulateGrad`` node holds the copy),
so the input's memory and the copy's ``.grad`` stay allocated after the backward. verl's
workaround ``resize_(0)``\\ s the storage of every input and grad; a storage is shared by every
view of it, so when an input is a chunk view of a tensor another node still reads, that node
reads freed memory (verl #7328: SIGSEGV on CPU, CUDA illegal memory access).

The mechanism, in one sentence: the recompute reads each requires-grad input through an
identity node (``_ReadThrough``) whose only graph edge goes to a 0-dim stand-in, and whose
backward hands the incoming gradient to the checkpoint's backward in place of the copy's
``.grad`` -- so a recompute graph that outlives the backward holds the stand-in, never the
input. No tensor's data is changed and no storage is freed: memory goes by reference counting
when its last real holder (the input, a view of it, a node that saved it) lets go, and every
holder reads what it would read without the reclaim.

What the recompute sees (the contract, checkable in ``_Recompute.__call__``):

* each routed input is a tensor on the input's storage with the same shape, strides, dtype,
  device, version counter and values as megatron's detached copy, ``requires_grad`` True,
  ``_base`` None -- but not a leaf: its ``grad_fn`` is the identity node. Its ``.grad`` is
  filled as a leaf's would be (the same gradient tensor, accumulated across backward calls)
  for whoever still holds it after the backward; ``register_post_accumulate_grad_hook`` on it
  raises (PyTorch refuses it on non-leaves); graph walks find the stand-in, not the input.
* an in-place change of its autograd history during the recompute (an in-place op with grad
  enabled, which megatron's leaf refuses; ``detach_()``) raises ``RuntimeError`` once the
  recompute returns, naming this fix.
* inputs that do not require grad, tensor subclasses (DTensor, Float8Tensor), non-strided
  layouts and recomputes that run with grad disabled are passed as megatron passes them, with
  megatron's own semantics (and leak).

Works with any reentrant checkpoint Function whose backward recomputes through
``ctx.run_function(*detached)`` and returns ``(None,) * k + tuple(d.grad for d in detached)``:
megatron-core's ``tensor_parallel.random.CheckpointFunction`` by default, and PyTorch's
``torch.utils.checkpoint.CheckpointFunction`` (``use_reentrant=True``) for torch-only tests.

Install order: the reclaim always wraps the module's *own* backward (``fixes.megatron.pristine``).
A backward assigned by someone else before the install (verl's
``apply_patch_megatron_recomputation_backward`` does, in its engine's init) is replaced with a
``RuntimeWarning`` naming it; one assigned *after* the install is named by a ``RuntimeWarning``
at the next checkpoint call (the reclaim also wraps ``CheckpointFunction.forward`` to see it),
and ``installed_reclaim()`` reports what is installed *now*.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable

import torch

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

PATCH_KIND = "read-through"


# --- the identity node ---------------------------------------------------------------------------


class _Slot:
    """Where one routed input's gradient goes: to the checkpoint's backward while it runs
    (``open``), and to the recompute's view of the input for whoever still holds it."""

    __slots__ = ("grad", "open", "view", "mirrored", "storage")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.open = True
        self.view: weakref.ref | None = None
        self.mirrored = False  # the view's .grad was set by us (reading it then warns not)
        self.storage = (0, 0)

    def receive(self, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if self.open:
            self.grad = grad if self.grad is None else self.grad + grad
        view = self.view()
        if view is not None:  # a leaf's .grad, as megatron's detached copy would have it
            previous = view.grad if self.mirrored else None
            view.grad = grad if previous is None else previous + grad
            self.mirrored = True


class _ReadThrough(torch.autograd.Function):
    """``value`` unchanged (a new tensor on its storage, sharing its version counter), with an
    autograd edge to ``stand_in`` only; the gradient goes to ``slot``."""

    @staticmethod
    def forward(ctx, stand_in, value, slot):
        ctx.slot = slot
        ctx.set_materialize_grads(False)  # no gradient stays no gradient, as for a leaf
        return value.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.receive(grad)
        return None, None, None


_READ_NODE = _ReadThrough._backward_cls


class _StandIn(torch.Tensor):
    """The leaf every identity node's edge goes to: one 0-dim tensor for the process. It never
    receives a gradient (the node returns None for it); it only makes the node's output require
    grad. A graph walk that reaches it (``AccumulateGrad.variable``) finds it where megatron's
    graph has the checkpoint's detached copy: reading its values raises instead of answering
    with a stand-in's; its metadata (``shape``, ``requires_grad``, ``grad``) reads as its own."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "__get__" or func is torch.Tensor.__hash__:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} on stackfix's recompute stand-in: with the "
            "recompute reclaim (fixes.megatron.apply_recompute_reclaim_patch) the recompute "
            "reads each checkpoint input through an identity node whose graph edge ends at this "
            "0-dim stand-in, not at the input's detached copy; the input is not reachable from "
            "the recompute graph. Remove the reclaim to walk megatron's own graph.")

    def __repr__(self) -> str:
        return "stackfix recompute stand-in (not a checkpoint input)"


_STAND_IN = torch.Tensor._make_subclass(_StandIn, torch.zeros(()), True)


def _routable(arg: object) -> bool:
    return (type(arg) in (torch.Tensor, torch.nn.Parameter) and arg.requires_grad
            and arg.layout is torch.strided)


class _Recompute:
    """``ctx.run_function`` for the duration of one checkpoint backward: the first call gets
    each routable input through an identity node; ``hand_over`` puts the gradients the nodes
    received into the backward's result, in place of the copies' (empty) ``.grad``."""

    __slots__ = ("run_function", "calls", "nargs", "slots")

    def __init__(self, run_function: Callable) -> None:
        self.run_function = run_function
        self.calls = 0
        self.nargs = 0
        self.slots: list[tuple[int, _Slot]] = []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls > 1 or not torch.is_grad_enabled():
            if self.calls == 1:
                self._passed(args)
            return self.run_function(*args, **kwargs)
        self.nargs = len(args)
        routed = list(args)
        for i, arg in enumerate(args):
            if not _routable(arg):
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    self._passed((arg,))
                continue
            slot = _Slot()
            if _observers:
                slot.storage = storage_of(arg)
            routed[i] = _ReadThrough.apply(_STAND_IN, arg.detach(), slot)
            slot.view = weakref.ref(routed[i])
            self.slots.append((i, slot))
        out = self.run_function(*routed, **kwargs)
        for i, _ in self.slots:
            if type(routed[i].grad_fn) is not _READ_NODE:
                raise RuntimeError(
                    f"stackfix recompute reclaim: the checkpointed function changed the autograd "
                    f"history of its input {i} in place during the recompute (an in-place op "
                    f"with grad enabled, or detach_()); megatron's own backward refuses this too "
                    "(a leaf that requires grad used in an in-place operation). Make the op "
                    "out of place, or remove the reclaim (fixes.megatron."
                    "remove_recompute_reclaim_patch) to get megatron's own error.")
        return out

    @staticmethod
    def _passed(args) -> None:
        for arg in args:
            if _observers and isinstance(arg, torch.Tensor) and arg.requires_grad:
                emit(ReclaimAction.PASSED, "input", *storage_of(arg))

    def hand_over(self, result: tuple) -> tuple:
        for _, slot in self.slots:
            slot.open = False
        if self.calls != 1:
            if any(slot.grad is not None for _, slot in self.slots):
                raise RuntimeError(
                    "stackfix recompute reclaim: the checkpoint's backward called "
                    f"ctx.run_function {self.calls} times and the first call's inputs received "
                    "gradients: which call's gradients it returns is not known. Remove the "
                    "reclaim for this checkpoint Function.")
            emit(ReclaimAction.UNOBSERVED, "checkpoint")
            warnings.warn(
                "stackfix reclaim: the checkpoint's backward did not call ctx.run_function "
                "exactly once; its own result is returned", RuntimeWarning, stacklevel=3)
            return result
        offset = len(result) - self.nargs
        if offset < 0:
            raise RuntimeError(
                f"stackfix recompute reclaim: the checkpoint's backward returned {len(result)} "
                f"gradients for {self.nargs} recompute inputs; not a checkpoint Function of the "
                "shape the reclaim wraps")
        result = list(result)
        for i, slot in self.slots:
            if result[offset + i] is not None:
                raise RuntimeError(
                    f"stackfix recompute reclaim: the checkpoint's backward returned a gradient "
                    f"for input {i} that the recompute never read; not a checkpoint Function of "
                    "the shape the reclaim wraps")
            result[offset + i], slot.grad = slot.grad, None
            if _observers:
                held = slot.view() is not None
                emit(ReclaimAction.HELD if held else ReclaimAction.RELEASED, "input",
                     *slot.storage)
        return tuple(result)


def _reclaiming(backward: Callable) -> Callable:
    @functools.wraps(backward)
    def read_through_backward(ctx, *grad_outputs):
        recompute = _Recompute(ctx.run_function)
        ctx.run_function = recompute
        try:
            result = backward(ctx, *grad_outputs)
        finally:
            ctx.run_function = recompute.run_function
        return recompute.hand_over(result)

    return read_through_backward


def apply_recompute_reclaim_patch(target: type | None = None) -> bool:
    """Install the reclaim on megatron-core's ``CheckpointFunction.backward`` (or on ``target``,
    a reentrant checkpoint Function of the same shape), around the module's own backward; a
    foreign backward (verl's reclaim) is replaced, with a warning. Returns False when it was
    already installed."""
    return install_backward_wrapper(PATCH_KIND, _reclaiming, target)


def remove_recompute_reclaim_patch(target: type | None = None) -> bool:
    """Restore the module's own backward. False when the reclaim was not what was installed."""
    return uninstall_backward_wrapper(PATCH_KIND, target)
