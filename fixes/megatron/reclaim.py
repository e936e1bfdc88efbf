"""The recompute reclaim for megatron-core's ``CheckpointFunction.backward``: it lets go of what
the checkpoint itself holds, and never shrinks or frees a storage.

The leak (Megatron-LM #3221 / #5197, #5227; verl #5251): with full recompute a module keeps a
recompute intermediate until its next forward. That intermediate's autograd graph ends at the
checkpoint's private detached copy of each input (its ``AccumulateGrad`` node), so the copy —
the input's memory and the copy's ``.grad`` — stays allocated after the backward. verl's
workaround ``resize_(0)``\\ s the storage of every input and grad. A storage is shared by every
view of it: when an input is a chunk view of a tensor another node still reads, that node reads
freed memory (verl #7328: SIGSEGV on CPU, CUDA illegal memory access).

The mechanism, in one sentence: after megatron's own backward has run, every requires-grad
detached copy that nothing but its own ``AccumulateGrad`` node still holds is pointed at a
one-element placeholder of the same shape (``copy.data = ...``) and its ``.grad`` slot is
emptied. Nothing else is touched; memory goes by reference counting when its last real holder
(the input, a view of it, a node that saved it) lets go — a use-after-free cannot happen.

Why detaching the copy is invisible to every reader:

* The input, its views and every other tensor on its storage are other TensorImpls: changing the
  copy's data pointer changes none of them (``tensor.data =`` swaps one TensorImpl's storage).
* What can see the copy itself: a Python reference (a module caching its recompute input; a
  tool keeping the recompute's frames alive), an autograd node that saved it and has not run (a
  side result built during the recompute and backwarded later), a view of it, and its
  ``AccumulateGrad``. The reclaim detaches only when ``sys.getrefcount`` finds no Python
  reference beyond its own and the TensorImpl's reference count is exactly two — its Python
  object and an ``AccumulateGrad`` that already existed. Anything else: the copy is ``kept``,
  untouched, and its memory goes when that holder lets go.
* ``AccumulateGrad`` reads only the copy's shape, dtype and device, which the placeholder keeps,
  and its ``.grad`` slot: a leaked graph backwarded again accumulates as before. The
  placeholder holds NaN, so a reader outside those counts (a raw pointer, a weak reference)
  would see NaNs — never freed memory.

Which checkpoint inputs are the detached copies is observed, not guessed: ``ctx.run_function``
is wrapped for the duration of the call and records what the recompute passes it. Works with any
reentrant checkpoint Function whose backward recomputes through ``ctx.run_function(*detached)``:
megatron-core's ``tensor_parallel.random.CheckpointFunction`` by default, and PyTorch's
``torch.utils.checkpoint.CheckpointFunction`` (``use_reentrant=True``) for torch-only tests.

Install order: the reclaim always wraps the module's *own* backward (``fixes.megatron.pristine``
recovers it from the installed source). A backward someone else assigned — verl's
``apply_patch_megatron_recomputation_backward`` does, in its engine's init — is replaced with a
warning naming it, never wrapped; ``installed_reclaim()`` reports what is installed *now*.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fixes.megatron.pristine import describe, is_pristine, pristine_backward
from fixes.megatron.storage import COUNTS_TENSOR_HOLDERS, python_refs_beyond, storage_key

__all__ = [
    "ReclaimEvent",
    "apply_recompute_reclaim_patch",
    "installed_reclaim",
    "placeholder_nbytes",
    "recompute_reclaim_events",
    "remove_recompute_reclaim_patch",
    "reset_backward",
]

PATCH_KIND = "alias-aware"


@dataclass(frozen=True)
class ReclaimEvent:
    """One decision of a reclaim about one checkpoint input (or its grad).

    ``action`` (role ``input``): ``refcounted`` (nothing but the checkpoint held the detached
    copy: no leak; reference counting frees input and grad as the checkpoint's node returns),
    ``detached`` (only its own ``AccumulateGrad`` — a leaked recompute graph — held the copy: it
    now points at a placeholder, so the leak no longer keeps the input's memory), ``kept``
    (something else can read the copy: untouched). Role ``grad``: ``dropped`` (the detached
    copy's ``.grad`` slot emptied; the grad itself was handed back to autograd). Role
    ``checkpoint``: ``unobserved`` (the backward did not recompute through ``ctx.run_function``
    exactly once: nothing was touched). Other reclaims (the harness's ``resize-all``) may emit
    their own actions, such as ``released``.
    """

    action: str
    role: str
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


def emit(action: str, role: str, tensor: torch.Tensor | None = None) -> None:
    """Record one decision about ``tensor``'s storage for every ``recompute_reclaim_events``."""
    if not _observers:
        return
    key, nbytes = (0, 0) if tensor is None else (storage_key(tensor),
                                                 tensor.untyped_storage().nbytes())
    event = ReclaimEvent(action, role, key, nbytes)
    with _observers_lock:
        for events in _observers:
            events.append(event)


# --- the checkpoint's detached inputs ------------------------------------------------------------


def call_observing_inputs(backward: Callable, ctx, grad_outputs) -> tuple[tuple, tuple | None]:
    """Run ``backward(ctx, *grad_outputs)``; return (its result, the args of the recompute).

    The recompute passes the checkpoint's private detached copies of its inputs to
    ``ctx.run_function``; a pass-through wrapper installed on ``ctx`` for the duration of the
    call records them. None if the backward did not recompute through it exactly once.
    """
    calls: list[tuple] = []
    run_function = ctx.run_function

    def observed(*args, **kwargs):  # no functools.wraps: it cost ~20 us per checkpoint
        calls.append(args)
        return run_function(*args, **kwargs)

    ctx.run_function = observed
    try:
        result = backward(ctx, *grad_outputs)
    finally:
        ctx.run_function = run_function
    args = calls[0] if len(calls) == 1 else None
    # ``observed`` can outlive this call (whoever keeps a frame of the recompute keeps it):
    # its record must not be one more holder of the detached copies.
    calls.clear()
    return result, args


# --- the reclaim ---------------------------------------------------------------------------------

_placeholders: dict[tuple, torch.Tensor] = {}


def placeholder_nbytes(dtype: torch.dtype) -> int:
    """The memory the reclaim allocates itself: one element of ``dtype`` per device, once per
    process (the placeholder every detached copy of that dtype and device points at)."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """A NaN broadcast to ``like``'s shape: its dtype and device, one element of memory."""
    key = (like.dtype, like.device)
    scalar = _placeholders.get(key)
    if scalar is None:
        scalar = _placeholders[key] = torch.full((), float("nan"), dtype=like.dtype,
                                                 device=like.device)
    return scalar.expand(like.shape)


def _only_its_accumulator_holds(copies: list, i: int) -> bool:
    """Is the one C++ holder of ``copies[i]`` (use count 2) its ``AccumulateGrad`` node?

    Asking for the gradient edge returns the accumulator that exists, or makes a new one, which
    would be one more holder: a count that rises means the holder was something else.
    """
    before = copies[i]._use_count()
    edge = torch.autograd.graph.get_gradient_edge(copies[i])
    existed = copies[i]._use_count() == before
    del edge
    return existed


def _settle(copies: list, i: int) -> None:
    """Decide for ``copies[i]`` (index, not element: a name bound to it is one more reference)."""
    if not (COUNTS_TENSOR_HOLDERS and type(copies[i]) is torch.Tensor
            and copies[i].layout is torch.strided):
        emit("kept", "input", copies[i])  # a wrapper subclass's counts do not describe its data
        return
    python = python_refs_beyond(copies, i)
    holders = copies[i]._use_count()  # its Python object and every C++ holder
    if python == 0 and holders == 1:
        emit("refcounted", "input", copies[i])
    elif python == 0 and holders == 2 and _only_its_accumulator_holds(copies, i):
        emit("detached", "input", copies[i])  # figures before the swap
        if copies[i].grad is not None:
            emit("dropped", "grad", copies[i].grad)
            copies[i].grad = None
        copies[i].data = _placeholder(copies[i])
    else:
        emit("kept", "input", copies[i])


def _reclaiming(backward: Callable) -> Callable:
    @functools.wraps(backward)
    def reclaiming_backward(ctx, *grad_outputs):
        result, args = call_observing_inputs(backward, ctx, grad_outputs)
        if args is None:
            emit("unobserved", "checkpoint")
            warnings.warn(
                "stackfix reclaim: the checkpoint's backward did not call ctx.run_function "
                "exactly once; nothing was reclaimed", RuntimeWarning, stacklevel=2)
            return result
        copies = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        del args  # our one reference to the copies is ``copies``
        for i in range(len(copies)):
            _settle(copies, i)
        return result

    return reclaiming_backward


# --- install / undo ------------------------------------------------------------------------------

_MARK = "__stackfix_reclaim__"
_install_lock = threading.Lock()
# target -> the module's own staticmethod object, once seen (undo puts back that very object)
_originals: dict[type, staticmethod] = {}


def _default_target() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom.CheckpointFunction


def _current(target: type) -> Callable | None:
    current = target.__dict__.get("backward")
    return getattr(current, "__func__", current)


def _own(target: type) -> staticmethod:
    """``target``'s own backward as a staticmethod (validating its shape on the way)."""
    recovered = pristine_backward(target)  # TypeError / RuntimeError for a Function of no known shape
    current = target.__dict__.get("backward")
    if isinstance(current, staticmethod) and is_pristine(target, current.__func__):
        _originals.setdefault(target, current)
    return _originals.get(target) or staticmethod(recovered)


def installed_reclaim(target: type | None = None) -> str | None:
    """What ``target.backward`` (megatron's CheckpointFunction by default) is *now*: a stackfix
    reclaim's kind (``"alias-aware"``), None for the module's own backward, or
    ``"foreign:<module.qualname (file:line)>"`` for anything else (verl's reclaim, say)."""
    target = _default_target() if target is None else target
    fn = _current(target)
    kind = getattr(fn, _MARK, None)
    if kind is not None:
        return kind
    return None if is_pristine(target, fn) else f"foreign:{describe(fn)}"


def install_backward_wrapper(
    kind: str, make_wrapper: Callable[[Callable], Callable], target: type | None = None
) -> bool:
    """Install ``make_wrapper(own_backward)`` on ``target`` (megatron's CheckpointFunction by
    default), where ``own_backward`` is the module's own, whatever is installed now: another
    stackfix reclaim is replaced; a foreign backward is replaced with a ``RuntimeWarning``
    naming it. False if ``kind`` is already what is installed (idempotent)."""
    target = _default_target() if target is None else target
    with _install_lock:
        current = _current(target)
        if getattr(current, _MARK, None) == kind:
            return False
        own = _own(target)
        if getattr(current, _MARK, None) is None and not is_pristine(target, current):
            warnings.warn(
                f"{target.__module__}.{target.__qualname__}.backward was replaced by "
                f"{describe(current)}; the {kind} reclaim replaces it and wraps the module's own "
                "backward instead", RuntimeWarning, stacklevel=3)
        wrapper = make_wrapper(own.__func__)
        setattr(wrapper, _MARK, kind)
        target.backward = staticmethod(wrapper)
        return True


def uninstall_backward_wrapper(kind: str, target: type | None = None) -> bool:
    """Put the module's own backward back if ``kind`` is what is installed; else False."""
    target = _default_target() if target is None else target
    with _install_lock:
        if getattr(_current(target), _MARK, None) != kind:
            return False
        target.backward = _own(target)
        return True


def reset_backward(target: type | None = None) -> str | None:
    """Put the module's own backward back, whatever is installed (a stackfix reclaim or a
    foreign one); returns what was installed, as ``installed_reclaim`` says it."""
    target = _default_target() if target is None else target
    with _install_lock:
        was = installed_reclaim(target)
        if was is not None:
            target.backward = _own(target)
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
