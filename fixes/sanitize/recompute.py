"""``recompute_sanitizer()``: a checkpointed region whose recompute computes something else
than its forward where backward uses it raises ``RecomputeMismatchError``, naming what differs
and where the recompute first departs from its forward.

Why: every silent failure of activation checkpointing is a recompute that computes something
else than the forward did, and autograd then backpropagates through those other activations:
the spmd mesh lost in the recompute skips torchtitan's collectives (verl #6950; at TP=2 the
gradients are wrong, no error), state that a later layer's forward overwrote (Megatron-LM #6793),
an effectful op run a second time (torchtitan #4568 / #4673), an RNG state not restored
(OLMo-core #828), an early-stopped recompute that never fills a saved tensor (pytorch#193671).
``torch.utils.checkpoint(determinism_check="default")`` compares only shapes, dtypes and devices
of the tensors the recompute saves, and nothing covers megatron-core's reentrant checkpoint.

What is judged (``_verdict``): what backward uses -- the tensors the forward saved for backward
against the recompute's (non-reentrant regions, matched as the checkpoint matches them), the
region's outputs (reentrant regions, whose forward runs without grad and saves nothing), and
the tensors outside the region a recompute leaves changed. Ops that differ while these are
equal are no error. Intended differences are declared where they are made
(``recompute_may_differ``, ``scratch_tensors``; megatron-core's no-grad aux loss and
``GlobalMemoryBuffer``, FSDP2's hooks and TransformerEngine's FP8 recompute are built in:
``_intended``).

What is wrapped while active (all put back on exit): the entry of each checkpoint
implementation, so that every region is seen whoever calls it --

* ``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` (non-reentrant
  ``checkpoint``, torch's ``checkpoint_wrapper``, torchtitan's AC, torch_remat, which replays
  through it);
* the same generator as ``torch.distributed._composable.checkpoint`` binds it (the composable
  ``checkpoint(module)``);
* ``torch.utils.checkpoint.CheckpointFunction.forward`` (``use_reentrant=True``);
* ``megatron.core.tensor_parallel.random.CheckpointFunction.forward`` and
  ``CheckpointWithoutOutput.checkpoint`` (megatron's selective recompute), also when
  megatron-core is imported while the sanitizer is active.

Values are compared bitwise, or within ``ATOMIC_RTOL`` from the first op that accumulates with
atomics on CUDA (``_fingerprint``). Not seen: regions under ``torch.compile``, ops on other
threads than the one that runs the region, state that is a Python value rather than a tensor
(its effect on the recomputed values is seen), checkpoint implementations other than the ones
above, and writes outside the region that no op dispatched makes (``UntypedStorage.resize_``,
``.data =``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.utils.checkpoint as torch_checkpoint

from fixes.sanitize._callsite import ActiveSlot, call_site
from fixes.sanitize._errors import (
    Divergence,
    RecomputeMismatchError,
    RecomputeSanitizerWarning,
    Verdict,
)
from fixes.sanitize._fingerprint import ATOMIC_RTOL
from fixes.sanitize._intended import recompute_may_differ, scratch_tensors
from fixes.sanitize._modes import VALUES, Values
from fixes.sanitize._on_import import OnImport
from fixes.sanitize._opsite import entry_frame
from fixes.sanitize._region import Region

__all__ = ["ATOMIC_RTOL", "Divergence", "RecomputeMismatchError", "RecomputeSanitizer",
           "RecomputeSanitizerWarning", "Values", "Verdict", "recompute_may_differ",
           "recompute_sanitizer", "scratch_tensors"]

_MEGATRON = "megatron.core.tensor_parallel.random"
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def _has_megatron() -> bool:
    return importlib.util.find_spec("megatron") is not None


@dataclass
class RecomputeSanitizer:
    """What ``recompute_sanitizer()`` yields: its values mode, the checkpoint entries it wraps,
    and counts of what it checked: regions recorded, recomputes judged, ops in the recomputes'
    op streams (``ops_compared``), op-stream fingerprints (forward and recompute together),
    saved tensors and outputs compared (and the recomputes' saved tensors fingerprinted), writes outside the regions checked (and into scratch, not checked), ops left out by
    declared intended differences, and the sanitizer's own failures (each region it could not
    check, with the reason)."""

    values: str = "all"
    sample_every: int = 8
    wrapped: list[str] = field(default_factory=list)
    regions: int = 0
    recomputes: int = 0
    ops_compared: int = 0
    fingerprints: int = 0
    saved_compared: int = 0
    saved_fingerprints: int = 0  # of the recomputes' saved tensors
    outputs_compared: int = 0
    outside_writes: int = 0
    scratch_writes: int = 0  # writes into declared scratch (not checked)
    lowerings_accepted: int = 0  # reentrant outputs compared within the lowering tolerance
    declared_ops: int = 0
    internal_errors: list[str] = field(default_factory=list)

    def _on(self) -> bool:
        return _slot.holds(self)

    def region(self, kind: str, fn, opaque: bool = False, reentrant: bool = True) -> Region:
        label = getattr(fn, "__qualname__", None) or type(fn).__name__
        return Region(kind, label, call_site(), self, opaque, reentrant)

    # -- the wrappers ---------------------------------------------------------------------------

    def wrap_generator(self, original):
        # functools.wraps: the original's attributes come along (a wrapper that marks itself
        # installed, as fixes.torchtitan's nested-checkpoint one does, is then not stacked
        # again on top of this one for every sanitizer entered after it).
        @functools.wraps(original)
        def _checkpoint_without_reentrant_generator(fn, *rest, **kwargs):
            if not self._on() or not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return (yield from original(fn, *rest, **kwargs))
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("torch_remat"):
                region = self.region("torch_remat", fn, opaque=True, reentrant=False)
            else:
                region = self.region("torch.utils.checkpoint, non-reentrant", fn,
                                     reentrant=False)
            entry = entry_frame(sys._getframe(1))
            inner = original(region.replaying(fn), *rest, **kwargs)
            next(inner)  # the checkpoint's hooks and the caller's forward context are entered
            frame = _checkpoint_frame(inner)
            if frame is not None:  # judge each recompute outside its contexts
                frame.recompute_fn = region.judging(frame.recompute_fn)
            try:
                with region.recording(entry):  # innermost: inside the caller's forward context
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


def _checkpoint_frame(generator):
    """The ``_CheckpointFrame`` a suspended ``_checkpoint_without_reentrant_generator`` made,
    through the generators that wrap it (another wrapper of the same name: ``yield from`` or
    ``next(inner)``, as an earlier sanitizer's left inside fixes.torchtitan's permanent one);
    None if this torch names it otherwise: its recomputes are then judged inside their
    contexts."""
    for _ in range(32):
        frame = getattr(generator, "gi_frame", None)
        if frame is None:
            return None
        found = frame.f_locals.get("new_frame")
        if callable(getattr(found, "recompute_fn", None)):
            return found
        generator = getattr(generator, "gi_yieldfrom", None) or frame.f_locals.get("inner")
    return None


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
def recompute_sanitizer(values: Values | Literal["all", "sampled", "none"] = Values.ALL,
                        sample_every: int = 8) -> Iterator[RecomputeSanitizer]:
    """While active, every checkpointed region records its forward and judges each recompute
    against it by what backward uses (the saved tensors of a non-reentrant region, the outputs
    of a reentrant one, and the tensors outside the region it leaves changed); a difference
    raises ``RecomputeMismatchError`` when the recompute ends, naming what differs and where
    the recompute first departs from its forward (op, position, both call sites). Not
    reentrant: RuntimeError if active (a test's own entry with the pytest plugin's arguments
    joins the plugin's, as ``storage_sanitizer()``'s does).

    ``values`` (a ``Values`` or its name): how much is fingerprinted, besides the metadata of
    everything and the contents of outside tensors a recompute writes. ``"all"``:
    every saved tensor, output and op of the op stream, so a difference in any of them is
    caught and the error names the first op whose values differ. ``"sampled"``: the outputs,
    every ``sample_every``-th saved tensor and op, each side's last saved tensor and op, and
    the op next to each fingerprinted saved tensor -- a difference that reaches the last saved
    tensor or an output is still caught, and the error names the interval of ops it arose in.
    ``"none"``: no fingerprint kernels and no op stream: metadata and writes outside the
    regions, and an error that names what differs (and a write's own site) but not where
    the recompute departs. ValueError for anything else."""
    if isinstance(values, Values):
        values = values.value
    if not isinstance(values, str) or values not in VALUES:
        raise ValueError(f"recompute_sanitizer: values must be one of "
                         f"{', '.join(map(repr, VALUES))} (or a Values), got {values!r}")
    if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1:
        raise ValueError(f"recompute_sanitizer: sample_every must be an int >= 1, got "
                         f"{sample_every!r}")
    arguments = f"values={values!r}, sample_every={sample_every}"
    joined = _slot.joinable(arguments)
    if joined is not None:  # the pytest plugin's, entered by this thread: this entry joins it
        yield joined
        return
    here = call_site()
    sanitizer = RecomputeSanitizer(values=values, sample_every=sample_every)
    _slot.claim(sanitizer, here, arguments)
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

    def patch_composable(module) -> None:
        # torch.distributed._composable.checkpoint binds the generator at its import.
        patches.append(_Patch(module, "_checkpoint_without_reentrant_generator",
                              sanitizer.wrap_generator))
        sanitizer.wrapped.append(f"{_COMPOSABLE}._checkpoint_without_reentrant_generator")

    try:
        patches.append(_Patch(torch_checkpoint, "_checkpoint_without_reentrant_generator",
                              sanitizer.wrap_generator))
        patches.append(_Patch(torch_checkpoint.CheckpointFunction, "forward",
                              lambda f: sanitizer.wrap_function_forward(
                                  f, "torch.utils.checkpoint, reentrant")))
        sanitizer.wrapped += ["torch.utils.checkpoint._checkpoint_without_reentrant_generator",
                              "torch.utils.checkpoint.CheckpointFunction.forward"]
        later = {}
        for name, patch, installed in ((_MEGATRON, patch_megatron, _has_megatron),
                                       (_COMPOSABLE, patch_composable, lambda: True)):
            if name in sys.modules:
                patch(sys.modules[name])
            elif installed():
                later[name] = patch
        if later:  # patched when imported while the sanitizer is active
            hook = OnImport(later)
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
