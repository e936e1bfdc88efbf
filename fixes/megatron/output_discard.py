"""megatron-core's ``CheckpointWithoutOutput`` frees only the outputs no other tensor shares.

The crash: selective recompute (``recompute_modules`` "layernorm", "moe_act", "mla_up_proj",
"gdn_norm_out") runs a module under ``tensor_parallel.CheckpointWithoutOutput`` and, once the
next module has read the result, ``discard_output_and_register_recompute`` calls
``untyped_storage().resize_(0)`` on every output, to recompute it in backward. A storage belongs
to every tensor on it, so an output that shares its storage with a checkpoint input -- a norm
that returns ``(normed, residual)`` with the residual being its input, as
``TEFusedResidualRMSNorm`` does (``fused_residual_rmsnorm=True``) -- frees the input: the layer's
residual add then reads freed memory (SIGSEGV on CPU, an illegal memory access on CUDA), and so
would the recompute, which reads the checkpoint's saved copy of that input. megatron-core 0.16.1
through 0.19.2 free every output; Megatron-LM main keeps such an output only where the caller
opts in with ``retain_input_tensors=True``, which main sets where a norm declares
``returns_residual`` (19deef67, #4497).

The fix, in one sentence: each output is judged when the checkpoint makes it, with
``fixes.megatron.is_storage_exclusive(output, owners=outputs)``, and the discard frees only the
outputs no tensor but the checkpoint's own outputs shared then -- whoever made the
``CheckpointWithoutOutput`` and whatever it runs. An output kept so is the memory of a tensor
someone else holds (an input, the checkpoint's saved copy of one, a parameter, a view's base);
every other output is freed and recomputed exactly as megatron does it.

Why judge at ``checkpoint`` time, not at the discard: by the discard the modules that read the
output have saved views of it for their backward (TE's GroupedLinear saves ``reshape`` +
``split`` pieces) -- exactly the memory megatron means to free, and indistinguishable then from
an input's. At ``checkpoint`` time only the run function has touched the outputs.

What it changes, on the class (``CheckpointWithoutOutput`` of the installed megatron-core):

* ``checkpoint``: megatron's own, then the judgement, kept on the object.
* the discard -- ``_discard_outputs`` where it exists (Megatron-LM main, also what its
  ``CheckpointWithoutOutputManager`` calls), else ``discard_output_and_register_recompute``:
  megatron's own, called with ``self.outputs`` narrowed to the outputs to free for the duration
  of the call (the recompute, later, sees every output in its place).
* ``_get_share_storage`` (megatron-core >= 0.19, a module function of ``tensor_parallel.random``):
  the recompute hands each output the recomputed output's memory with a C++ ``share_storage``;
  for a kept output that is the same memory, and re-pointing a storage at its own data would
  free it under itself, so such a pair is skipped (main has the same test, 19deef67).

Outputs the counts cannot inspect (tensor subclasses such as TE's Float8Tensor, sparse layouts)
are kept -- the safe answer, at the cost of that output's memory until backward.
``apply_output_discard_patch`` / ``remove_output_discard_patch`` are idempotent and restore
exactly what they replaced.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from fixes.megatron.storage import is_storage_exclusive

__all__ = ["apply_output_discard_patch", "installed_output_discard", "kept_outputs",
           "remove_output_discard_patch"]

_KEPT = "_stackfix_kept_outputs"  # per checkpoint object: which outputs the discard keeps
_MARK = "__stackfix_output_discard__"
_lock = threading.Lock()
_replaced: dict[tuple[object, str], object] = {}  # (owner, attribute) -> what was there


def _random_module():
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom


def kept_outputs(checkpoint) -> tuple[bool, ...]:
    """Per output of ``checkpoint`` (a ``CheckpointWithoutOutput``), whether the installed patch
    keeps it at the discard; empty when the patch did not judge this checkpoint."""
    return getattr(checkpoint, _KEPT, ())


def _judge(outputs) -> tuple[bool, ...]:
    """True for each output whose storage another tensor than the outputs shares now."""
    tensors = tuple(o for o in outputs if isinstance(o, torch.Tensor))
    return tuple(isinstance(o, torch.Tensor) and not is_storage_exclusive(o, owners=tensors)
                 for o in outputs)


def _judging(checkpoint: Callable) -> Callable:
    @functools.wraps(checkpoint)
    def checkpoint_judging_outputs(self, run_function, *args):
        setattr(self, _KEPT, ())
        before = self.outputs
        result = checkpoint(self, run_function, *args)
        # Megatron sets new outputs unless it skipped checkpointing (CUDA graph warmup).
        if self.outputs is not None and self.outputs is not before:
            setattr(self, _KEPT, _judge(self.outputs))
        return result

    return checkpoint_judging_outputs


def _discarding_exclusive(discard: Callable) -> Callable:
    @functools.wraps(discard)
    def discard_exclusive_outputs(self, *args, **kwargs):
        kept = getattr(self, _KEPT, ())
        outputs = self.outputs
        if not any(kept) or outputs is None:
            return discard(self, *args, **kwargs)
        # Megatron's own discard, shown only the outputs to free; every output back in its
        # place for the recompute, which pairs them with the recomputed ones by position.
        self.outputs = tuple(o for o, keep in zip(outputs, kept, strict=True) if not keep)
        try:
            return discard(self, *args, **kwargs)
        finally:
            self.outputs = outputs

    return discard_exclusive_outputs


def _skipping_same_storage(get_share_storage: Callable) -> Callable:
    @functools.wraps(get_share_storage)
    def get_share_storage_skipping_kept():
        share_storage = get_share_storage()

        def share_storage_unless_same(dst, src):
            # A kept output already holds the recomputed output's memory (Megatron-LM 19deef67).
            if dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                return None
            return share_storage(dst, src)

        return share_storage_unless_same

    return get_share_storage_skipping_kept


def _targets() -> list[tuple[object, str, Callable[[Callable], Callable]]]:
    mrandom = _random_module()
    cls = mrandom.CheckpointWithoutOutput
    discard = "_discard_outputs" if "_discard_outputs" in vars(cls) else (
        "discard_output_and_register_recompute")
    targets = [(cls, "checkpoint", _judging), (cls, discard, _discarding_exclusive)]
    if hasattr(mrandom, "_get_share_storage"):
        targets.append((mrandom, "_get_share_storage", _skipping_same_storage))
    return targets


def installed_output_discard() -> bool:
    """Whether the patch is on the installed megatron-core's ``CheckpointWithoutOutput``."""
    cls = _random_module().CheckpointWithoutOutput
    return getattr(vars(cls).get("checkpoint"), _MARK, False)


def apply_output_discard_patch() -> bool:
    """Install the patch on megatron-core's ``CheckpointWithoutOutput`` (every instance, made
    before or after). Returns False when it was already installed."""
    with _lock:
        if installed_output_discard():
            return False
        for owner, name, wrap in _targets():
            original = vars(owner)[name]
            wrapper = wrap(original)
            setattr(wrapper, _MARK, True)
            _replaced[(owner, name)] = original
            setattr(owner, name, wrapper)
        return True


def remove_output_discard_patch() -> bool:
    """Put megatron-core's own methods back. False when the patch was not installed."""
    with _lock:
        if not installed_output_discard():
            return False
        for (owner, name), original in list(_replaced.items()):
            setattr(owner, name, original)
            del _replaced[(owner, name)]
        return True
