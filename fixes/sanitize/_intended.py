"""Differences between a checkpointed region's forward and its recompute that the code
making them intends, declared where they are made: ``recompute_may_differ`` (a context
manager and decorator) around code, ``scratch_tensors`` for buffers, and the same
declarations built in for the frameworks this harness serves (``BUILT_IN``).

What a declaration changes (``recompute_sanitizer`` keeps judging by what backward uses: the
saved tensors and region outputs are compared whatever is declared):

* the ops run inside a declared block are left out of the op stream, so a block that runs on
  one side only (a cache built on first use, a hook that runs in the forward only, a loss
  computed only under grad) neither shifts nor is named as the place a divergence starts;
* what its writes into tensors outside the region may do in a recompute (``Writes``):
  ``restore`` -- a stash / restore: its writes must leave the state as the recompute found it
  (checked, as for undeclared writes); ``update`` -- an update the forward did not make
  (skipped under no-grad) and the recompute makes once: its net change is accepted when the
  forward made no write under the same declaration, and reported when it did (then the update
  is applied twice); ``scratch`` -- contents no one reads after: not checked.

Built in, each a declaration on the upstream functions that make the difference:

* megatron-core's MoE aux loss (``update``): the router skips its aux-loss and z-loss ops,
  and their logging into the aux-loss tracker, when grad is disabled -- which is how
  megatron's reentrant checkpoint runs the forward -- and runs them in the recompute
  (``router.py``: ``self.training and torch.is_grad_enabled()``).
* FSDP2 (``scratch``): ``fully_shard``'s hooks unshard, cast and reshard parameters and open
  ``record_function`` ranges in the forward; in a non-reentrant recompute the pre-backward
  hook has unsharded already. ``record_function``'s ops (namespace ``profiler``) are never
  part of the op stream.
* TransformerEngine's FP8 recompute (``restore``): ``copy_forward_fp8_meta_tensors_for_
  recompute`` stashes the forward's scales and amax history, ``get_old_fp8_meta_tensors_for_
  recompute`` puts them in place for the recompute and ``restore_fp8_meta_tensors`` puts the
  current ones back (TransformerEngine #24; a restore that does not restore is a real bug,
  TransformerEngine #1723, so the restore is checked).
* megatron-core's ``GlobalMemoryBuffer`` (scratch tensors): the buffers sequence-parallel
  all-gathers and attention write into and read straight back.
* grad-mode-dependent lowering (``LOWERING_OPS``): ``torch.matmul`` of a >= 3-D tensor and a
  2-D one folds the batch into one ``mm`` when the 2-D operand does not require grad and runs
  ``expand`` / ``clone`` / ``bmm`` when it does -- so in a reentrant region, whose forward runs
  without grad and its recompute with, the ops differ, and the results may differ in the last
  bits (float sums taken in another order). Where the first departure of the op streams is
  such a block (view, copy and matmul ops only, at one call site), the region's outputs are
  compared within ``_fingerprint.ATOMIC_RTOL`` instead of bitwise.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Literal


class Writes(enum.StrEnum):
    """What a declared block's writes into tensors outside the region may do in a recompute."""

    RESTORE = "restore"
    UPDATE = "update"
    SCRATCH = "scratch"


@dataclass(frozen=True, slots=True)
class Declaration:
    """One intended difference: why, and what its writes may do (``Writes``)."""

    reason: str
    writes: Writes


_local = threading.local()


def current() -> Declaration | None:
    """The innermost ``recompute_may_differ`` block active on this thread, if any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def entered() -> int:
    """How many declared blocks this thread has entered (the detect tier asks whether a
    recompute ran one: it cannot tell their writes from the region's)."""
    return getattr(_local, "entered", 0)


class recompute_may_differ(contextlib.ContextDecorator):  # noqa: N801 - used as a function
    """Declare that the code inside (a ``with`` block, or a decorated function) may run or
    write differently in a checkpointed region's recompute than in its forward, and why.

    ``writes``: what its writes into tensors outside the region may do in a recompute --
    ``"restore"`` (the default: a stash or restore, which must leave the state as the
    recompute found it), ``"update"`` (an update the forward skipped and the recompute makes
    once) or ``"scratch"`` (contents no one reads afterwards). Its ops are left out of the op
    stream either way. Values that leave the block into saved tensors or region outputs are
    compared as always. Costs nothing when no sanitizer is active. Usable on any thread;
    nests (the innermost declaration applies)."""

    def __init__(self, reason: str,
                 writes: Literal["restore", "update", "scratch"] | Writes = "restore"):
        if not isinstance(reason, str) or not reason:
            raise ValueError("recompute_may_differ: give the reason (a non-empty string)")
        try:
            kind = Writes(writes)
        except ValueError:
            raise ValueError(f"recompute_may_differ: writes must be one of "
                             f"{', '.join(repr(w.value) for w in Writes)}, got {writes!r}"
                             ) from None
        self.declaration = Declaration(reason, kind)

    def __enter__(self):
        _local.__dict__.setdefault("stack", []).append(self.declaration)
        _local.entered = getattr(_local, "entered", 0) + 1
        return self.declaration

    def __exit__(self, *exc):
        _local.stack.pop()
        return False


# -- scratch tensors ---------------------------------------------------------------------------

_scratch: list[tuple[weakref.ref, str]] = []
_scratch_lock = threading.Lock()


def scratch_tensors(*tensors, reason: str) -> None:
    """Declare ``tensors`` scratch: buffers whose contents no one reads without writing them
    first (a workspace, an all-gather buffer), so that a recompute's writes into them are not
    side effects. Held weakly: a tensor that is freed is forgotten."""
    import torch

    if not reason:
        raise ValueError("scratch_tensors: give the reason (a non-empty string)")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"scratch_tensors takes tensors, got {type(t).__name__}")
    with _scratch_lock:
        _scratch[:] = [(ref, why) for ref, why in _scratch if ref() is not None]
        _scratch.extend((weakref.ref(t), reason) for t in tensors)


def scratch_reason(storage_key: int) -> str | None:
    """Why the storage ``storage_key`` (``untyped_storage()._cdata``) is scratch, if it is:
    declared through ``scratch_tensors``, or one of megatron-core's ``GlobalMemoryBuffer``
    buffers. Looked up only when a recompute writes outside its region."""
    with _scratch_lock:
        live = [(ref(), why) for ref, why in _scratch]
    for t, why in live:
        if t is not None and _key(t) == storage_key:
            return why
    for t in _megatron_buffers():
        if _key(t) == storage_key:
            return ("megatron-core GlobalMemoryBuffer scratch (sequence-parallel all-gather "
                    "and attention workspaces)")
    return None


def _key(t) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _megatron_buffers() -> list:
    state = sys.modules.get("megatron.core.parallel_state")
    holder = getattr(state, "_GLOBAL_MEMORY_BUFFER", None)
    buffers = getattr(holder, "buffer", None)
    return list(buffers.values()) if isinstance(buffers, dict) else []


# -- built-in declarations, by the code that makes the difference -----------------------------

MEGATRON_AUX_LOSS = Declaration(
    "megatron-core MoE aux loss: the router computes and logs it only under grad, so in "
    "megatron's reentrant checkpoint the no-grad forward skips it and the recompute runs it",
    Writes.UPDATE)
FSDP2_HOOKS = Declaration(
    "FSDP2 fully_shard hooks: unshard, parameter casts, reshard and record_function ranges "
    "run in the forward, not in the recompute", Writes.SCRATCH)
TE_FP8_RECOMPUTE = Declaration(
    "TransformerEngine FP8 recompute: the forward's scales and amax history stashed, put in "
    "place for the recompute and restored after it", Writes.RESTORE)

_S = os.sep
# (path suffix, function names) -> declaration; matched on a code object's file and name.
BUILT_IN: tuple[tuple[str, frozenset[str], Declaration], ...] = (
    (f"megatron{_S}core{_S}transformer{_S}moe{_S}router.py",
     frozenset({"_apply_aux_loss", "_apply_seq_aux_loss", "_apply_global_aux_loss",
                "attach_and_log_load_balancing_loss", "apply_z_loss"}), MEGATRON_AUX_LOSS),
    (f"megatron{_S}core{_S}transformer{_S}moe{_S}moe_utils.py",
     frozenset({"save_to_aux_losses_tracker", "compute_routing_scores_for_aux_loss",
                "switch_load_balancing_loss_func", "sequence_load_balancing_loss_func",
                "z_loss_func", "get_tokens_per_expert_and_token_count"}), MEGATRON_AUX_LOSS),
    (f"transformer_engine{_S}pytorch{_S}fp8.py",
     frozenset({"copy_forward_fp8_meta_tensors_for_recompute",
                "get_old_fp8_meta_tensors_for_recompute", "restore_fp8_meta_tensors"}),
     TE_FP8_RECOMPUTE),
    (f"transformer_engine{_S}pytorch{_S}quantization.py",
     frozenset({"copy_forward_fp8_meta_tensors_for_recompute",
                "get_old_fp8_meta_tensors_for_recompute", "restore_fp8_meta_tensors"}),
     TE_FP8_RECOMPUTE),
)
_FSDP2_DIR = f"{_S}torch{_S}distributed{_S}fsdp{_S}_fully_shard{_S}"
# Ops of these namespaces are no part of any op stream (record_function's enter / exit).
UNRECORDED_NAMESPACES = frozenset({"profiler"})


def _aten_packets(*names: str) -> frozenset:
    import torch

    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


class _Lowering:
    """The view, copy and matmul ops one matmul lowers to (looked up on first use: this
    module imports no torch)."""

    _ops: frozenset | None = None

    def __contains__(self, packet) -> bool:
        if self._ops is None:
            type(self)._ops = _aten_packets(
                "expand", "view", "_unsafe_view", "reshape", "_reshape_alias", "clone",
                "contiguous", "mm", "bmm", "matmul", "mv", "dot", "t", "transpose", "permute",
                "unsqueeze", "squeeze", "as_strided", "alias", "unfold", "expand_as")
        return packet in self._ops


LOWERING_OPS = _Lowering()


def built_in(code) -> Declaration | None:
    """The built-in declaration that covers ops run directly in ``code``, if any."""
    path = code.co_filename
    if _FSDP2_DIR in path:
        return FSDP2_HOOKS
    for suffix, names, declaration in BUILT_IN:
        if code.co_name in names and path.endswith(suffix):
            return declaration
    return None
