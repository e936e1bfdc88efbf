"""The recompute reclaims the harness compares, by name (``VARIANTS``), installed on a reentrant
checkpoint Function with ``install_reclaim``:

* ``none``: the module's own backward (megatron-core's, or PyTorch's reentrant checkpoint's);
* ``resize-all``: verl's mechanism on any reentrant checkpoint Function: ``resize_(0)`` of every
  requires-grad recompute input and its grad (verl's own patch can only target megatron-core);
* ``verl-0.8.0``, ``verl-0.9.1``: verl's released ``apply_patch_megatron_recomputation_backward``
  (``repro.verl_release``), on megatron-core's ``CheckpointFunction`` only;
* ``megatron-6339``: Megatron-LM #6339 (open): after the backward, ``.grad = None`` on each of the
  checkpoint's detached inputs (the returned grads are kept), so an input the recompute graph
  keeps alive no longer keeps its grad;
* ``gc-collect``: radixark/miles #2862: ``gc.collect()`` when each recomputed backward returns,
  so a reference cycle holding the recompute graph goes at once, not at CPython's next collection;
* ``ours``: ``fixes.megatron.apply_recompute_reclaim_patch``.

Unfixed baselines and rival fixes are harness code: none of these but ``ours`` ships in ``fixes``.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections.abc import Callable

import torch

__all__ = ["RIVALS", "VARIANTS", "VERL_RECLAIMS", "install_reclaim", "install_verl_reclaim"]

VERL_RECLAIMS = {"verl-0.8.0": "0.8.0", "verl-0.9.1": "0.9.1"}
# rival fixes of the #3221 leak, by name -> where they come from
RIVALS = {"megatron-6339": "Megatron-LM #6339", "gc-collect": "radixark/miles #2862"}
VARIANTS = ("none", "resize-all", *VERL_RECLAIMS, *RIVALS, "ours")


def _observing_inputs(backward: Callable, ctx, grad_outputs) -> tuple[tuple, list]:
    """``backward(ctx, *grad_outputs)`` and the arguments its recompute called
    ``ctx.run_function`` with (megatron's: the detached inputs), seen through a pass-through
    ``run_function`` for the call."""
    calls, run_function = [], ctx.run_function

    def observed(*args, **kwargs):
        calls.append(args)
        return run_function(*args, **kwargs)

    ctx.run_function = observed
    try:
        result = backward(ctx, *grad_outputs)
    finally:
        ctx.run_function = run_function
    return result, list(calls[0]) if len(calls) == 1 else []


def _clear_detached_grads(backward: Callable) -> Callable:
    """Megatron-LM #6339's change, as a wrapper: the grads are collected (the result holds
    them), then each detached input's ``.grad`` is set to None."""

    @functools.wraps(backward)
    def clear_grad_backward(ctx, *grad_outputs):
        result, inputs = _observing_inputs(backward, ctx, grad_outputs)
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        return result

    return clear_grad_backward


def _collect_after(backward: Callable) -> Callable:
    """radixark/miles #2862's change: a full ``gc.collect()`` after each recomputed backward
    (it runs even with the collector disabled)."""

    @functools.wraps(backward)
    def collecting_backward(ctx, *grad_outputs):
        result = backward(ctx, *grad_outputs)
        gc.collect()
        return result

    return collecting_backward


def _resize_all(backward: Callable) -> Callable:
    """verl's reclaim mechanism on any reentrant checkpoint: after the backward, ``resize_(0)``
    each requires-grad recompute input and its grad, handing back clones of the grads. Which
    tensors the recompute got is recorded by a pass-through ``ctx.run_function`` for the call."""
    from fixes.megatron.reclaim_events import ReclaimAction, emit
    from fixes.megatron.storage import storage_key

    @functools.wraps(backward)
    def resize_all_backward(ctx, *grad_outputs):
        result, inputs = _observing_inputs(backward, ctx, grad_outputs)
        result = tuple(g.clone() if isinstance(g, torch.Tensor) else g for g in result)
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                emit(ReclaimAction.RESIZED, "input", storage_key(t),
                     t.untyped_storage().nbytes())
                t.untyped_storage().resize_(0)
                if t.grad is not None:
                    t.grad.untyped_storage().resize_(0)
        return result

    return resize_all_backward


def install_verl_reclaim(version: str) -> None:
    """verl ``version``'s ``apply_patch_megatron_recomputation_backward``, as released and as
    its Megatron engine calls it (it assigns megatron-core's ``CheckpointFunction.backward``)."""
    from repro.verl_release import import_verl

    import_verl(version, "verl.models.mcore.patch").apply_patch_megatron_recomputation_backward()


def install_reclaim(variant: str, target: type | None = None, over: str | None = None) -> None:
    """Install one reclaim variant (``VARIANTS``) on ``target`` (megatron's CheckpointFunction
    when None), after putting the module's own backward back; ``none`` only does that.

    ``over``: a verl variant installed first, as verl's Megatron engine installs it in its
    init; ``variant`` then meets it as it would in a verl process (ours replaces it)."""
    from fixes.megatron import apply_recompute_reclaim_patch
    from fixes.megatron.backward_patch import (
        default_target,
        install_backward_wrapper,
        reset_backward,
    )

    for name in (variant, over or "none"):
        if name not in VARIANTS:
            raise ValueError(f"unknown reclaim variant {name!r}; allowed: {VARIANTS}")
    if over is not None and over not in VERL_RECLAIMS:
        raise ValueError(f"over= takes a verl reclaim, one of {tuple(VERL_RECLAIMS)}; got {over!r}")
    target = default_target() if target is None else target
    reset_backward(target)
    for name in (over, variant):
        if name in VERL_RECLAIMS:
            if target is not default_target():
                raise ValueError("verl's reclaim patches megatron-core's CheckpointFunction only")
            install_verl_reclaim(VERL_RECLAIMS[name])
        elif name == "resize-all":
            install_backward_wrapper("resize-all", _resize_all, target)
        elif name == "megatron-6339":
            install_backward_wrapper(name, _clear_detached_grads, target)
        elif name == "gc-collect":
            install_backward_wrapper(name, _collect_after, target)
        elif name == "ours":
            with warnings.catch_warnings():
                if over is not None:  # "replaced verl's backward": what this order is about
                    warnings.simplefilter("ignore", RuntimeWarning)
                apply_recompute_reclaim_patch(target)
