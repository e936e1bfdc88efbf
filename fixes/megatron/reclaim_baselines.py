"""BASELINES FOR COMPARISON — NOT FIXES. Do not install these in training.

Two reference implementations of verl's recompute reclaim, written from its description
(verl #5251 and #7328), so that repros, tests and benchmarks can compare
them with the alias-aware reclaim in :mod:`fixes.megatron.reclaim`:

* ``unsafe``: after the checkpoint's backward, ``resize_(0)`` the storage of every
  requires-grad input and of its grad (the grads handed back to autograd are clones, so the
  previous layer still gets them). It frees storage other tensors share: a chunk view's base or
  sibling saved by another node is read after it is freed (the crash of verl #7328).
* ``mtp-skip``: the same, except when an object whose class is named
  ``MultiTokenPredictionLayer`` is found in ``ctx.run_function`` — in a closure cell (what
  verl probes) or as the ``__self__`` of a bound method (how megatron-core 0.16.1 / 0.19.2 pass
  ``MultiTokenPredictionLayer._proj_and_transformer_layer``; verl's closure probe alone would
  never fire there). It avoids the MTP crash and gives up that checkpoint's memory, and it
  still crashes on any other shared storage.

Both wrap the installed backward the same way the fix does (no copy of its body) and emit the
same ReclaimEvents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fixes.megatron.reclaim import (
    call_observing_inputs,
    install_backward_wrapper,
    release_storage,
    tensor_args,
    uninstall_backward_wrapper,
)

__all__ = [
    "MTP_LAYER_CLASS_NAME",
    "apply_mtp_skip_reclaim_patch",
    "apply_unsafe_reclaim_patch",
    "remove_mtp_skip_reclaim_patch",
    "remove_unsafe_reclaim_patch",
]

UNSAFE = "unsafe"
MTP_SKIP = "mtp-skip"
MTP_LAYER_CLASS_NAME = "MultiTokenPredictionLayer"


def _free_all(recompute_args) -> None:
    for t in tensor_args(recompute_args):
        if t.requires_grad:
            release_storage(t, "input")
            if t.grad is not None:
                release_storage(t.grad, "grad")


def _clone_grads(result: tuple) -> tuple:
    # verl clones the grads it returns before freeing the detached inputs' own .grad.
    return tuple(g.clone() if isinstance(g, torch.Tensor) else g for g in result)


def _unsafe(backward: Callable) -> Callable:
    @functools.wraps(backward)
    def unsafe_reclaim_backward(ctx, *grad_outputs):
        result, recompute_args = call_observing_inputs(backward, ctx, grad_outputs)
        result = _clone_grads(result)
        _free_all(recompute_args)
        return result

    return unsafe_reclaim_backward


def _holds_mtp_layer(run_function) -> bool:
    """verl #7328's probe (class name in a closure cell), plus a bound method's ``__self__``."""
    candidates = [getattr(run_function, "__self__", None)]
    for cell in getattr(run_function, "__closure__", None) or ():
        try:
            candidates.append(cell.cell_contents)
        except ValueError:  # empty cell
            continue
    return any(type(c).__name__ == MTP_LAYER_CLASS_NAME for c in candidates)


def _mtp_skip(backward: Callable) -> Callable:
    @functools.wraps(backward)
    def mtp_skip_reclaim_backward(ctx, *grad_outputs):
        skip = _holds_mtp_layer(ctx.run_function)
        result, recompute_args = call_observing_inputs(backward, ctx, grad_outputs)
        result = _clone_grads(result)
        if not skip:
            _free_all(recompute_args)
        return result

    return mtp_skip_reclaim_backward


def apply_unsafe_reclaim_patch(target: type | None = None) -> bool:
    """BASELINE (crashes on shared storage): verl's reclaim as described. Idempotent."""
    return install_backward_wrapper(UNSAFE, _unsafe, target)


def remove_unsafe_reclaim_patch(target: type | None = None) -> bool:
    return uninstall_backward_wrapper(UNSAFE, target)


def apply_mtp_skip_reclaim_patch(target: type | None = None) -> bool:
    """BASELINE: verl #7328's reclaim that skips checkpoints holding an MTP layer. Idempotent."""
    return install_backward_wrapper(MTP_SKIP, _mtp_skip, target)


def remove_mtp_skip_reclaim_patch(target: type | None = None) -> bool:
    return uninstall_backward_wrapper(MTP_SKIP, target)
