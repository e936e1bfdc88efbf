"""The output discards of megatron-core's ``CheckpointWithoutOutput`` the harness compares, by
name (``KINDS``), installed on the installed megatron-core's class with ``output_discard``:

* ``released``: the class as shipped (0.16.1 .. 0.19.2): every output's storage ``resize_(0)``;
* ``main-retain``: Megatron-LM main's ``retain_input_tensors=True`` (19deef67, #4497), put on
  every checkpoint: outputs whose storage ``data_ptr`` is a checkpoint input's are kept;
* ``none``: nothing freed (the recompute hook is still registered, the outputs keep their
  memory until backward) -- what the layer costs without output-discarding recompute's saving;
* ``ours``: ``fixes.megatron.apply_output_discard_patch``.

Unfixed baselines are harness code: none of these but ``ours`` ships in ``fixes``. The two
harness baselines narrow ``self.outputs`` for megatron's own discard, as the fix does, and skip
the recompute's ``share_storage`` onto an output's own memory (megatron >= 0.19), as main does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

__all__ = ["KINDS", "output_discard"]

KINDS = ("released", "main-retain", "none", "ours")


def _input_pointers(args) -> set[int]:
    return {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}


def _harness_patch(mrandom, keep: Callable[[object, tuple], tuple[bool, ...]]) -> Callable[[], None]:
    """Install a discard that keeps the outputs ``keep(checkpoint, args)`` marks; returns the
    undo."""
    cls = mrandom.CheckpointWithoutOutput
    saved = {name: vars(cls)[name] for name in ("checkpoint", "discard_output_and_register_recompute")}
    own_checkpoint, own_discard = saved["checkpoint"], saved["discard_output_and_register_recompute"]

    @functools.wraps(own_checkpoint)
    def checkpoint(self, run_function, *args):
        result = own_checkpoint(self, run_function, *args)
        self._harness_kept = keep(self, args) if self.outputs is not None else ()
        return result

    @functools.wraps(own_discard)
    def discard(self, hook_tensor):
        outputs, kept = self.outputs, getattr(self, "_harness_kept", ())
        if outputs is not None and any(kept):
            self.outputs = tuple(o for o, k in zip(outputs, kept, strict=True) if not k)
        try:
            return own_discard(self, hook_tensor)
        finally:
            self.outputs = outputs

    cls.checkpoint, cls.discard_output_and_register_recompute = checkpoint, discard
    own_get = vars(mrandom).get("_get_share_storage")
    if own_get is not None:
        def get_share_storage():
            share = own_get()
            return lambda dst, src: None if (dst.untyped_storage().data_ptr()
                                             == src.untyped_storage().data_ptr()) else share(dst, src)

        mrandom._get_share_storage = get_share_storage

    def undo():
        for name, fn in saved.items():
            setattr(cls, name, fn)
        if own_get is not None:
            mrandom._get_share_storage = own_get

    return undo


@contextlib.contextmanager
def output_discard(kind: str) -> Iterator[None]:
    """``kind`` (one of ``KINDS``) on megatron-core's ``CheckpointWithoutOutput`` for the block;
    the class as shipped after it."""
    if kind not in KINDS:
        raise ValueError(f"unknown output discard {kind!r}; allowed: {', '.join(KINDS)}")
    from megatron.core.tensor_parallel import random as mrandom

    from fixes.megatron import apply_output_discard_patch, remove_output_discard_patch

    remove_output_discard_patch()
    undo = None
    if kind == "ours":
        apply_output_discard_patch()
    elif kind == "main-retain":
        undo = _harness_patch(mrandom, lambda ckpt, args: tuple(
            o.untyped_storage().data_ptr() in _input_pointers(args) for o in ckpt.outputs))
    elif kind == "none":
        undo = _harness_patch(mrandom, lambda ckpt, args: (True,) * len(ckpt.outputs))
    try:
        yield
    finally:
        if kind == "ours":
            remove_output_discard_patch()
        if undo is not None:
            undo()
