"""TransformerEngine's delayed-scaling FP8 recompute, modelled in plain torch (TransformerEngine
is not installed here): the shape of ``FP8GlobalStateManager``'s recompute handling in
``transformer_engine/pytorch/fp8.py``, on a linear layer that quantizes its input to float8.

- The forward quantizes with the live ``scale`` and writes the input's amax into the live
  ``amax_history`` (TE's cast kernels do both on the module's ``fp8_meta``).
- The end of ``fp8_autocast`` (after the forward, before backward) updates the live scale
  from the amax history and rolls it (``reduce_and_update_fp8_tensors``).
- So the recompute must not read the live meta: the checkpointed forward stashes copies
  (``copy_forward_fp8_meta_tensors_for_recompute``), the recompute keeps the live ones aside
  and puts the stash in place (``get_old_fp8_meta_tensors_for_recompute``), and puts the live
  ones back after (``restore_fp8_meta_tensors``) -- TransformerEngine#24.

The checkpoint is TransformerEngine's default, reentrant one (``te.checkpoint``): modelled by
torch's reentrant checkpoint of a function that knows its first call is the checkpointed
forward and every later one a recompute (TE's ``activation_recompute_forward`` phases).

``stash``: whether the checkpointed forward stashes at all (TransformerEngine#24 added it);
``keep_copies``: whether the recompute keeps copies of the live meta aside or references to
them (references: TransformerEngine#1723 -- the restore then puts back the stash it was just
given, and the update made between forward and backward is lost).

The three functions are declared to the recompute sanitizer as TE's are built in
(``recompute_may_differ(..., writes="restore")``): their ops run on one side only, and their
writes must restore.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque

import torch

from fixes.sanitize import recompute_may_differ

FP8_MAX = 448.0  # float8_e4m3fn
_phase = threading.local()
RESTORE = "FP8 meta: the forward's scales put in place for the recompute, then restored"


def recompute_phase() -> bool:
    return getattr(_phase, "recompute", False)


def checkpointed_forward() -> bool:
    return getattr(_phase, "forward", False)


@contextlib.contextmanager
def _phase_set(name: str):
    setattr(_phase, name, True)
    try:
        yield
    finally:
        setattr(_phase, name, False)


def phases(fn):
    """``fn`` for one reentrant checkpoint call: its first call in the checkpointed-forward
    phase, every later call in the recompute phase (the flags te.checkpoint sets)."""
    calls = 0

    def region(*args):
        nonlocal calls
        calls += 1
        with _phase_set("forward" if calls == 1 else "recompute"):
            return fn(*args)

    return region


class Meta:
    def __init__(self):
        self.scale = torch.ones(1)
        self.amax_history = torch.zeros(4)
        self.stash: deque = deque()
        self.updated: tuple | None = None


@recompute_may_differ(RESTORE)
def copy_forward_meta_for_recompute(meta: Meta) -> None:
    meta.stash.append((meta.scale.clone(), meta.amax_history.clone()))


@recompute_may_differ(RESTORE)
def get_old_meta_for_recompute(meta: Meta, keep_copies: bool) -> None:
    if keep_copies:
        meta.updated = (meta.scale.clone(), meta.amax_history.clone())
    else:
        meta.updated = (meta.scale, meta.amax_history)
    scale, amax_history = meta.stash.popleft()
    meta.scale.copy_(scale)  # <- diverges: TransformerEngine#1723
    meta.amax_history.copy_(amax_history)


@recompute_may_differ(RESTORE)
def restore_meta(meta: Meta) -> None:
    scale, amax_history = meta.updated
    meta.scale.copy_(scale)
    meta.amax_history.copy_(amax_history)


def update_scale(meta: Meta) -> None:
    """The end of fp8_autocast: the scale from the amax history, the history rolled."""
    with torch.no_grad():
        meta.scale.copy_(FP8_MAX / meta.amax_history.max().clamp(min=1e-12))
        meta.amax_history.copy_(torch.roll(meta.amax_history, 1))
        meta.amax_history[0] = 0.0


class FP8Linear(torch.nn.Module):
    def __init__(self, dim: int, stash: bool, keep_copies: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.meta = Meta()
        self.stash, self.keep_copies = stash, keep_copies

    def forward(self, x):
        if self.stash and recompute_phase():
            get_old_meta_for_recompute(self.meta, self.keep_copies)
        elif self.stash and checkpointed_forward():
            copy_forward_meta_for_recompute(self.meta)
        scale = self.meta.scale.clone()  # <- diverges: TransformerEngine#24
        quantized = (x * scale).to(torch.float8_e4m3fn)  # the cast reads the live scale
        with torch.no_grad():
            self.meta.amax_history[0] = torch.maximum(self.meta.amax_history[0], x.abs().max())
        out = (quantized.to(x.dtype) / scale) @ self.weight
        if self.stash and recompute_phase():
            restore_meta(self.meta)
        return out


def step(checkpointing: bool, stash: bool, keep_copies: bool) -> dict[str, torch.Tensor]:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = FP8Linear(16, stash, keep_copies)
    x = torch.randn(8, 16, requires_grad=True)
    layer.meta.amax_history.copy_(torch.tensor([3.0, 1.0, 0.5, 0.25]))
    update_scale(layer.meta)  # an earlier step's update
    if checkpointing:
        y = checkpoint(phases(layer), x, use_reentrant=True)
    else:
        y = layer(x)
    update_scale(layer.meta)  # fp8_autocast exits after the forward, before backward
    y.pow(2).sum().backward()
    return {"x.grad": x.grad, "weight.grad": layer.weight.grad, "scale": layer.meta.scale,
            "amax_history": layer.meta.amax_history}
