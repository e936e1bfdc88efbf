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

import enum
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fixes.megatron.pristine import describe, is_own_backward, own_backward, remember_own_backward
from fixes.megatron.storage import storage_key

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


class ReclaimAction(enum.StrEnum):
    """What a reclaim did with one checkpoint input (``role`` input) or checkpoint call
    (``role`` checkpoint); one meaning each."""

    #: The recompute read the input through the identity node, and once the checkpoint's
    #: backward had returned nothing referred to the recompute's view of it: the recompute keeps
    #: none of its memory (a leaked recompute graph holds the stand-in).
    RELEASED = "released"
    #: Read through the identity node, and after the backward something outside the recompute
    #: graph still held the recompute's view (a Python reference, a node that saved it, a view
    #: of it): that holder keeps it, readable and unchanged, until it lets go.
    HELD = "held"
    #: A requires-grad input the reclaim does not route (a tensor subclass, a non-strided
    #: layout, a recompute run with grad disabled): the recompute got megatron's own detached
    #: copy, with megatron's semantics, leak included.
    PASSED = "passed"
    #: Role checkpoint: the backward did not call ``ctx.run_function`` exactly once, so which
    #: call's inputs are the checkpoint's is not known: megatron's own result was returned.
    UNOBSERVED = "unobserved"
    #: A storage resized to zero bytes: verl's mechanism, in the harness's unfixed reclaims
    #: only. stackfix's reclaim never emits it.
    RESIZED = "resized"


@dataclass(frozen=True)
class ReclaimEvent:
    """One decision of a reclaim about one checkpoint input (or call)."""

    action: ReclaimAction
    role: str  # "input" | "checkpoint"
    storage: int  # StorageImpl address at the decision: compare with storage.storage_key
    nbytes: int


_observers: list[list[ReclaimEvent]] = []
_observers_lock = threading.Lock()


@contextmanager
def recompute_reclaim_events() -> Iterator[list[ReclaimEvent]]:
    """Collect the ReclaimEvents of every reclaim (any variant) made inside the block."""
    events: list[ReclaimEvent] = []
    with _observers_lock:
        _observers.append(events)
    try:
        yield events
    finally:
        with _observers_lock:
            _observers.remove(events)


def emit(action: ReclaimAction, role: str, storage: int = 0, nbytes: int = 0) -> None:
    """Record one decision for every ``recompute_reclaim_events`` block."""
    if not _observers:
        return
    event = ReclaimEvent(ReclaimAction(action), role, storage, nbytes)
    with _observers_lock:
        for events in _observers:
            events.append(event)


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    return storage_key(tensor), tensor.untyped_storage().nbytes()


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
                slot.storage = _storage_of(arg)
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
                emit(ReclaimAction.PASSED, "input", *_storage_of(arg))

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


# --- install / undo ------------------------------------------------------------------------------

_MARK = "__stackfix_reclaim__"
_install_lock = threading.Lock()
# target -> the forward that was in place when a stackfix reclaim was installed
_forwards: dict[type, staticmethod] = {}
_named: set[tuple[type, int]] = set()  # (target, id of a backward) already named in a warning


def _default_target() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom.CheckpointFunction


def _current(target: type) -> Callable | None:
    current = target.__dict__.get("backward")
    return getattr(current, "__func__", current)


def installed_reclaim(target: type | None = None) -> str | None:
    """What ``target.backward`` (megatron's CheckpointFunction by default) is *now*: a stackfix
    reclaim's kind (``PATCH_KIND``), None for the module's own backward, or
    ``"foreign:<module.qualname (file:line)>"`` for anything else (verl's reclaim, say)."""
    target = _default_target() if target is None else target
    remember_own_backward(target)
    fn = _current(target)
    kind = getattr(fn, _MARK, None)
    if kind is not None:
        return kind
    return None if is_own_backward(target, fn) else f"foreign:{describe(fn)}"


def _watching(target: type, forward: Callable, kind: str) -> Callable:
    """``forward`` that names, once, a backward assigned over the ``kind`` reclaim."""

    @functools.wraps(forward)
    def forward_watching_backward(ctx, *args, **kwargs):
        current = _current(target)
        if getattr(current, _MARK, None) != kind and (target, id(current)) not in _named:
            _named.add((target, id(current)))
            warnings.warn(
                f"{target.__module__}.{target.__qualname__}.backward was replaced by "
                f"{describe(current)} after stackfix's {kind} reclaim was installed: that "
                "backward runs now, not stackfix's (verl's reclaim resize_(0)s checkpoint "
                "inputs; a chunk view shared with another reader then reads freed memory, "
                "verl #7328). Apply the reclaim after it (apply_recompute_reclaim_patch) or "
                "install the verl plugin, which keeps verl from assigning it.",
                RuntimeWarning, stacklevel=3)
        return forward(ctx, *args, **kwargs)

    setattr(forward_watching_backward, _MARK, kind)
    return forward_watching_backward


def install_backward_wrapper(
    kind: str, make_wrapper: Callable[[Callable], Callable], target: type | None = None
) -> bool:
    """Install ``make_wrapper(own_backward)`` on ``target`` (megatron's CheckpointFunction by
    default), where ``own_backward`` is the module's own, whatever is installed now: another
    stackfix reclaim is replaced; a foreign backward is replaced with a ``RuntimeWarning``
    naming it. ``target.forward`` is wrapped to name a backward assigned later. False if
    ``kind`` is already what is installed (idempotent)."""
    target = _default_target() if target is None else target
    with _install_lock:
        current = _current(target)
        if getattr(current, _MARK, None) == kind:
            return False
        own = own_backward(target).__func__  # TypeError / RuntimeError before any change
        if getattr(current, _MARK, None) is None and not is_own_backward(target, current):
            warnings.warn(
                f"{target.__module__}.{target.__qualname__}.backward was replaced by "
                f"{describe(current)}; the {kind} reclaim replaces it and wraps the module's own "
                "backward instead", RuntimeWarning, stacklevel=3)
        wrapper = make_wrapper(own)
        setattr(wrapper, _MARK, kind)
        target.backward = staticmethod(wrapper)
        forward = target.__dict__["forward"]
        if getattr(forward.__func__, _MARK, None) is not None:  # another reclaim's watcher
            forward = _forwards[target]
        _forwards[target] = forward
        target.forward = staticmethod(_watching(target, forward.__func__, kind))
        return True


def _restore(target: type) -> None:
    target.backward = own_backward(target)
    forward = target.__dict__.get("forward")
    if target in _forwards and getattr(getattr(forward, "__func__", None), _MARK, None):
        target.forward = _forwards.pop(target)


def uninstall_backward_wrapper(kind: str, target: type | None = None) -> bool:
    """Put the module's own backward (and forward) back if ``kind`` is what is installed; else
    False."""
    target = _default_target() if target is None else target
    with _install_lock:
        if getattr(_current(target), _MARK, None) != kind:
            return False
        _restore(target)
        return True


def reset_backward(target: type | None = None) -> str | None:
    """Put the module's own backward back, whatever is installed (a stackfix reclaim or a
    foreign one); returns what was installed, as ``installed_reclaim`` says it."""
    target = _default_target() if target is None else target
    with _install_lock:
        was = installed_reclaim(target)
        if was is not None:
            _restore(target)
        return was


def apply_recompute_reclaim_patch(target: type | None = None) -> bool:
    """Install the reclaim on megatron-core's ``CheckpointFunction.backward`` (or on ``target``,
    a reentrant checkpoint Function of the same shape), around the module's own backward; a
    foreign backward (verl's reclaim) is replaced, with a warning. Returns False when it was
    already installed."""
    return install_backward_wrapper(PATCH_KIND, _reclaiming, target)


def remove_recompute_reclaim_patch(target: type | None = None) -> bool:
    """Restore the module's own backward. False when the reclaim was not what was installed."""
    return uninstall_backward_wrapper(PATCH_KIND, target)
