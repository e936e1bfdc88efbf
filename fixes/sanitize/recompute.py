"""``recompute_sanitizer()``: a checkpointed region whose recompute does not replay its forward
raises ``RecomputeMismatchError`` at the first op that differs, naming it.

Why: every silent failure of activation checkpointing is a recompute that computes something
else than the forward did, and autograd then backpropagates through those other activations:
the spmd mesh lost in the recompute skips torchtitan's collectives (verl #6950; at TP=2 the
gradients are wrong, no error), state that a later layer's forward overwrote (Megatron-LM #6793),
an effectful op run a second time (torchtitan #4568 / #4673), an RNG state not restored.
``torch.utils.checkpoint(determinism_check="default")`` compares only shapes, dtypes and devices
of the tensors the recompute saves, and nothing covers megatron-core's reentrant checkpoint.

What is wrapped while active (all put back on exit): the entry of each checkpoint
implementation, so that every region is seen whoever calls it --

* ``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` (non-reentrant
  ``checkpoint``, torch's ``checkpoint_wrapper``, torchtitan's AC, torch_remat, which replays
  through it);
* ``torch.utils.checkpoint.CheckpointFunction.forward`` (``use_reentrant=True``);
* ``megatron.core.tensor_parallel.random.CheckpointFunction.forward`` and
  ``CheckpointWithoutOutput.checkpoint`` (megatron's selective recompute), also when
  megatron-core is imported while the sanitizer is active.

Each region's forward and recompute run under the dispatch modes of ``_region`` (the contract
is stated there); values are compared bitwise, or within ``ATOMIC_RTOL`` from the first op that
accumulates with atomics on CUDA (``_fingerprint``). torch_remat's SAVE ops (run in the forward,
loaded in the recompute) are not compared, the ops that read their outputs are. Not seen: regions under ``torch.compile``, ops on other threads than the one
that runs the region, state that is a Python value rather than a tensor (its effect on the
recomputed values is seen).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint as torch_checkpoint

from fixes.sanitize._callsite import ActiveSlot, call_site
from fixes.sanitize._fingerprint import ATOMIC_RTOL
from fixes.sanitize._modes import VALUES
from fixes.sanitize._on_import import OnImport
from fixes.sanitize._region import RecomputeMismatchError, Region

__all__ = ["ATOMIC_RTOL", "RecomputeMismatchError", "RecomputeSanitizer", "recompute_sanitizer"]

_MEGATRON = "megatron.core.tensor_parallel.random"


@dataclass
class RecomputeSanitizer:
    """What ``recompute_sanitizer()`` yields: its values mode, the checkpoint entries it wraps,
    and counts of what it checked (regions recorded, recomputes and ops compared, ops whose
    values were fingerprinted, forward and recompute together)."""

    values: str = "all"
    sample_every: int = 8
    wrapped: list[str] = field(default_factory=list)
    regions: int = 0
    recomputes: int = 0
    ops_compared: int = 0
    fingerprints: int = 0

    def _on(self) -> bool:
        return _slot.holds(self)

    def region(self, kind: str, fn, opaque: bool = False,
               replays_to_end: bool = True) -> Region:
        label = getattr(fn, "__qualname__", None) or type(fn).__name__
        return Region(kind, label, call_site(), self, opaque, replays_to_end)

    # -- the wrappers ---------------------------------------------------------------------------

    def wrap_generator(self, original):
        def _checkpoint_without_reentrant_generator(fn, *rest, **kwargs):
            if not self._on() or not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return (yield from original(fn, *rest, **kwargs))
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("torch_remat"):
                region = self.region("torch_remat", fn, opaque=True, replays_to_end=False)
            else:
                region = self.region("torch.utils.checkpoint, non-reentrant", fn,
                                     replays_to_end=False)
            inner = original(region.replaying(fn), *rest, **kwargs)
            next(inner)  # the checkpoint's hooks and the caller's forward context are entered
            try:
                with region.recording():  # innermost: inside the caller's forward context
                    yield
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as exc:
                inner.throw(exc)
                raise
            try:
                next(inner)
            except StopIteration:
                return
            raise AssertionError("torch.utils.checkpoint's generator yielded more than twice")

        return _checkpoint_without_reentrant_generator

    def wrap_function_forward(self, original, kind: str):
        def forward(ctx, run_function, *args):
            if self._on() and not torch.compiler.is_compiling():
                run_function = self.region(kind, run_function).function(run_function)
            return original(ctx, run_function, *args)

        return staticmethod(forward)

    def wrap_checkpoint_method(self, original, kind: str):
        def checkpoint(obj, run_function, *args):
            if self._on() and not torch.compiler.is_compiling():
                run_function = self.region(kind, run_function).function(run_function)
            return original(obj, run_function, *args)

        return checkpoint


class _Patch:
    """``owner.name = wrapper`` for the sanitizer's duration; restored only if still ours."""

    def __init__(self, owner, name: str, make):
        self.owner, self.name = owner, name
        self.original = owner.__dict__[name]
        self.wrapper = make(self.original.__func__ if isinstance(self.original, staticmethod)
                            else self.original)
        setattr(owner, name, self.wrapper)

    def undo(self) -> None:
        if self.owner.__dict__.get(self.name) is self.wrapper:
            setattr(self.owner, self.name, self.original)


_slot = ActiveSlot("recompute_sanitizer()")


@contextlib.contextmanager
def recompute_sanitizer(values: str | bool = "all",
                        sample_every: int = 8) -> Iterator[RecomputeSanitizer]:
    """While active, every checkpointed region records its forward's ops and compares each
    recompute with them; the first difference raises ``RecomputeMismatchError`` naming the op,
    its position in the region, what differs and both call sites. Not reentrant: RuntimeError
    if active.

    ``values``: what of the ops' values is compared, besides every op and its outputs'
    metadata. ``"all"`` (or True): a fingerprint of every op's outputs, so the error names the
    first op whose values differ. ``"sampled"``: of every ``sample_every``-th op and of each
    side's last op -- a difference that reaches the region's output is still caught, and the
    error names the interval of ops it arose in; the fingerprint kernels drop by that factor.
    Reentrant regions (torch's ``use_reentrant=True``, megatron-core's) are sampled from the
    first; a non-reentrant or torch_remat recompute stops after the last saved tensor, short of
    the forward's last op, so such a region is fingerprinted in full until a recompute at its
    checkpoint call (in this process, under any sanitizer) has said where it stops, and
    sampled with that op after.
    ``"none"`` (or False): no fingerprint kernels. ValueError for anything else."""
    if values is True or values is False:
        values = "all" if values else "none"
    if values not in VALUES:
        raise ValueError(f"recompute_sanitizer: values must be one of "
                         f"{', '.join(map(repr, VALUES))} (or True / False), got {values!r}")
    if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1:
        raise ValueError(f"recompute_sanitizer: sample_every must be an int >= 1, got "
                         f"{sample_every!r}")
    here = call_site()
    sanitizer = RecomputeSanitizer(values=values, sample_every=sample_every)
    _slot.claim(sanitizer, here)
    patches: list[_Patch] = []
    hook = None

    def patch_megatron(module) -> None:
        cls = module.CheckpointFunction
        patches.append(_Patch(cls, "forward", lambda f: sanitizer.wrap_function_forward(
            f, "megatron-core tensor_parallel CheckpointFunction")))
        sanitizer.wrapped.append(f"{_MEGATRON}.CheckpointFunction.forward")
        if hasattr(module, "CheckpointWithoutOutput"):  # selective recompute (recompute_modules)
            patches.append(_Patch(module.CheckpointWithoutOutput, "checkpoint",
                                  lambda f: sanitizer.wrap_checkpoint_method(
                                      f, "megatron-core CheckpointWithoutOutput")))
            sanitizer.wrapped.append(f"{_MEGATRON}.CheckpointWithoutOutput.checkpoint")

    try:
        patches.append(_Patch(torch_checkpoint, "_checkpoint_without_reentrant_generator",
                              sanitizer.wrap_generator))
        patches.append(_Patch(torch_checkpoint.CheckpointFunction, "forward",
                              lambda f: sanitizer.wrap_function_forward(
                                  f, "torch.utils.checkpoint, reentrant")))
        sanitizer.wrapped += ["torch.utils.checkpoint._checkpoint_without_reentrant_generator",
                              "torch.utils.checkpoint.CheckpointFunction.forward"]
        if _MEGATRON in sys.modules:
            patch_megatron(sys.modules[_MEGATRON])
        elif importlib.util.find_spec("megatron") is not None:
            hook = OnImport({_MEGATRON: patch_megatron})
            sys.meta_path.insert(0, hook)
        yield sanitizer
    finally:
        try:
            if hook is not None:
                sys.meta_path.remove(hook)
            for patch in reversed(patches):
                patch.undo()
        finally:
            _slot.release()
