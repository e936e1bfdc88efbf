"""Readers of a checkpoint's recompute input that no count of holders can see, each a step run
with and without the reclaim (imported by the child interpreters of
tests/test_reclaim_value_safety.py).

Every case builds the Megatron-LM #3221 / #5227 leak (the checkpointed module keeps its
recompute output) and one more reader of the recompute's input: a CPU-offload pack hook that
keeps only a weak reference and a host copy, a custom autograd Function that gets the input
inside a list, a no-grad view kept for later, a tool writing into the input after the
backward, a tool reading it after the backward. ``run(case, target, reclaim)`` returns what the
readers saw: the values must equal the step's without the reclaim, or the reader must fail
with a Python error -- never NaN, zero or stale data.

``target``: ``"torch"`` (PyTorch's reentrant checkpoint) or ``"megatron"`` (megatron-core's
``tensor_parallel.checkpoint``, on CPU through ``fixes.testing.megatron_on_cpu``).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils.checkpoint as tcp
from torch import nn


def _checkpoint(target: str):
    if target == "torch":
        return tcp.CheckpointFunction, lambda fn, *a: tcp.checkpoint(fn, *a, use_reentrant=True)
    from megatron.core import tensor_parallel

    return (tensor_parallel.random.CheckpointFunction,
            lambda fn, *a: tensor_parallel.checkpoint(fn, False, *a))


@contextlib.contextmanager
def _target(target: str, reclaim: bool, device: str = "cpu"):
    """The checkpoint call of ``target``, with the reclaim installed on its Function when
    ``reclaim`` (megatron's on a CPU-only machine through ``megatron_on_cpu``)."""
    from fixes.megatron import apply_recompute_reclaim_patch, remove_recompute_reclaim_patch

    on_cpu = contextlib.nullcontext()
    if target == "megatron" and device == "cpu":
        from fixes.testing import megatron_on_cpu

        on_cpu = megatron_on_cpu()
    with on_cpu:
        cls, checkpoint = _checkpoint(target)
        if reclaim:
            apply_recompute_reclaim_patch(cls)
        try:
            yield checkpoint
        finally:
            if reclaim:
                remove_recompute_reclaim_patch(cls)


def _layer():
    torch.manual_seed(0)
    return nn.Linear(8, 8), nn.Parameter(torch.linspace(-1.0, 1.0, 8))


def _input():
    h = torch.linspace(-2.0, 3.0, 32).reshape(4, 8).requires_grad_()
    return h, h * 1.0  # a non-leaf input, only the checkpoint's after ``del``


def _step_then_side(checkpoint, segment, w, side) -> dict:
    """One checkpointed step, then the side result the recompute built, backwarded after it."""
    h, inp = _input()
    out = checkpoint(segment, inp)
    del inp
    out.sum().backward()
    side[-1].backward()
    return {"w.grad": w.grad, "h.grad": h.grad}


def offload_weak_pack(checkpoint) -> dict:
    """A CPU-offload ``saved_tensors_hooks`` whose pack keeps a weak reference to the tensor and
    a host copy (unpack prefers the live tensor), around a side result built in the recompute
    and backwarded after the main backward."""
    lin, w = _layer()
    side, leak = [], []

    def pack(t):
        return weakref.ref(t), t.detach().clone()

    def unpack(packed):
        live = packed[0]()
        return live if live is not None else packed[1]

    def segment(x):
        out = lin(x).tanh()
        if torch.is_grad_enabled():
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                side.append((x * w).sum())
            leak.append(out)
        return out

    return _step_then_side(checkpoint, segment, w, side)


class BoxedScale(torch.autograd.Function):
    """``(box[0] * w).sum()``, given the tensor it saves inside a list (not as an autograd input
    of its own): only ``w`` gets a gradient, read from the saved tensor in its backward."""

    @staticmethod
    def forward(ctx, w, box):
        ctx.save_for_backward(box[0])
        ctx.w_shape = w.shape
        return (box[0].detach() * w).sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.detach().sum_to_size(ctx.w_shape), None


def function_given_a_list(checkpoint) -> dict:
    """No leak: a custom autograd Function built in the recompute saves the input it got inside
    a list; its backward, run after the main backward, reads that input."""
    lin, w = _layer()
    side = []

    def segment(x):
        if torch.is_grad_enabled():
            side.append(BoxedScale.apply(w, [x]))
        return lin(x).tanh()

    return _step_then_side(checkpoint, segment, w, side)


def no_grad_view(checkpoint) -> dict:
    """No leak at all: the recompute keeps a no-grad view of its input for later."""
    lin, _ = _layer()
    views = []

    def segment(x):
        if torch.is_grad_enabled():
            with torch.no_grad():
                views.append(x[-1])
        return lin(x).tanh()

    h, inp = _input()
    out = checkpoint(segment, inp)
    del inp
    out.sum().backward()
    return {"view": views[0].clone(), "view._base": views[0]._base.clone(), "h.grad": h.grad}


def _weakly_seen_inputs(checkpoint, steps: int):
    """``steps`` leaky checkpointed steps; weak references to each recompute's input."""
    lin, _ = _layer()
    seen, leak = [], []

    def segment(x):
        out = lin(x).tanh()
        if torch.is_grad_enabled():
            seen.append(weakref.ref(x))
            leak.append(out)
        return out

    for _ in range(steps):
        h, inp = _input()
        out = checkpoint(segment, inp)
        del inp
        out.sum().backward()
    return seen, leak


def write_after_backward(checkpoint) -> dict:
    """A tool zeroes the first step's recompute input after its backward, then reads the
    second step's."""
    seen, _leak = _weakly_seen_inputs(checkpoint, 1)
    with torch.no_grad():
        seen[0]().zero_()
    seen2, _leak2 = _weakly_seen_inputs(checkpoint, 1)
    return {"second input": seen2[0]().clone()}


def read_after_backward(checkpoint) -> dict:
    """A tool reads the recompute input after the backward: a sign test and an argmax, whose
    answers are not NaN even when the input is."""
    seen, _leak = _weakly_seen_inputs(checkpoint, 1)
    x = seen[0]()
    return {"positive": (x > 0).sum(), "argmax": x.argmax()}


CASES = {
    "offload-weak-pack": offload_weak_pack,
    "function-given-a-list": function_given_a_list,
    "no-grad-view": no_grad_view,
    "write-after-backward": write_after_backward,
    "read-after-backward": read_after_backward,
}


def run(case: str, target: str, reclaim: bool) -> dict | BaseException:
    """What the case's readers saw, or the Python error a reader got."""
    with _target(target, reclaim) as checkpoint:
        try:
            return CASES[case](checkpoint)
        except (AttributeError, TypeError, RuntimeError) as e:  # a reader failing loudly
            return e


def verdict(case: str, target: str) -> str:
    """``same`` (every value equals the step's without the reclaim), ``loud: <error>`` (a
    reader got a Python error), or ``WRONG: <what>`` (a reader saw another value)."""
    reference = run(case, target, reclaim=False)
    assert isinstance(reference, dict), f"the case fails without the reclaim: {reference!r}"
    got = run(case, target, reclaim=True)
    if isinstance(got, BaseException):
        return f"loud: {type(got).__name__}: {got}"
    wrong = [name for name, value in reference.items()
             if not torch.equal(value, got[name])]
    if wrong:
        return "WRONG: " + "; ".join(f"{n}: {got[n].flatten()[:4].tolist()} instead of "
                                     f"{reference[n].flatten()[:4].tolist()}" for n in wrong)
    return "same"
