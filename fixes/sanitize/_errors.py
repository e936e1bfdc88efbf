"""What ``recompute_sanitizer()`` reports: the error, what of the region's result differs
(``Verdict``) and where the recompute first departs from its forward (``Divergence``); the
errors of a detection the locator did not locate and of a region never recomputed."""

from __future__ import annotations

import enum

import torch
from torch.utils.checkpoint import CheckpointError


class Verdict(enum.StrEnum):
    """What backward would use that the recompute made differently from the forward."""

    SAVED_TENSOR = "saved tensor"  # a tensor saved for backward (non-reentrant checkpoint)
    OUTPUT = "output"  # a region output (reentrant: backward differentiates the recompute's)
    SAVED_COUNT = "saved tensor count"  # the recompute saved fewer tensors than the forward
    SIDE_EFFECT = "side effect"  # a tensor outside the region left changed by the recompute
    # a reentrant region no input of which requires grad: never recomputed, its parameters
    # get no gradient
    NEVER_RECOMPUTED = "never recomputed"


class Divergence(enum.StrEnum):
    """Where, in the op stream, the recompute first departs from its forward."""

    VALUES = "values"  # the same op at the same call site, other values
    METADATA = "metadata"  # the same op at the same call site, other shapes / dtypes / devices
    OP = "op"  # an op one side ran and the other did not (or ran another one there)
    EARLY_STOP = "early stop"  # the forward wrote the saved tensor after the recompute stopped
    SIDE_EFFECT = "side effect"  # the recompute's write into a tensor outside the region
    UNLOCATED = "not located"  # the op streams agree where they were compared


class RecomputeMismatchError(CheckpointError):
    """A checkpointed region's recompute computed something else than its forward, where
    backward would use it. A ``torch.utils.checkpoint.CheckpointError`` (a RuntimeError): a
    user's ``except CheckpointError`` catches it. A non-reentrant recompute that saves another
    count or metadata of tensors fails torch's own check: torch's error is raised, this one's
    text on it as a note. ``verdict`` (a ``Verdict``) says what differs, ``item`` which one;
    ``what`` (a ``Divergence``) where the recompute first departs from its forward, at op
    ``position`` of the recompute's op stream (of the forward's, for an op only the forward
    ran), op ``op``; the sites are ``file:line in function`` tuples, innermost first, empty
    for the side that did not run the op."""

    def __init__(self, message: str, *, region: str, verdict: Verdict, item: str,
                 what: Divergence, position: int | None, op: str | None,
                 forward_site: tuple[str, ...], recompute_site: tuple[str, ...]):
        self.region, self.verdict, self.item = region, verdict, item
        self.what, self.position, self.op = what, position, op
        self.forward_site, self.recompute_site = forward_site, recompute_site
        super().__init__(message)


class RecomputeSanitizerWarning(RuntimeWarning):
    """The sanitizer could not check a region (its own failure, never the user's): the
    region runs unchecked, and the reason is given."""


def unlocated_error(found, why: str) -> RecomputeMismatchError:
    message = (f"recompute of checkpointed region {found.region} differs from its forward "
               f"({found.verdict}): {found.item}: {found.detail}. Not located: {why}.")
    return RecomputeMismatchError(
        message, region=found.region, verdict=found.verdict, item=found.item,
        what=Divergence.UNLOCATED, position=None, op=None, forward_site=(), recompute_site=())


def never_recomputed_error(region: str, roots, ran=None) -> RecomputeMismatchError | None:
    """A reentrant region entered with grad enabled whose inputs none require grad is never
    recomputed (its output has no grad_fn): the trainable parameters its function uses get no
    gradient, silently (a frozen base model under PEFT, detached MTP inputs; torch's reentrant
    checkpoint only warns, megatron's says nothing). The error naming them, or None if every
    parameter it reaches (narrowed to the modules its forward ``ran``: megatron's layer
    regions hold the whole block, whose other layers' parameters are not theirs) is frozen."""
    from fixes.sanitize._reach import reached, tensor_name  # the walk needs torch's modules

    trainable = [t for t in reached(roots, ran)
                 if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    if not trainable:
        return None
    names = []
    for t in trainable[:8]:
        name = tensor_name(t, roots)
        names.append(name if name not in (None, "the region's argument")
                     else f"a parameter of shape {list(t.shape)}")
    listed = ", ".join(names) + (
        f" and {len(trainable) - 8} more" if len(trainable) > 8 else "")
    message = (f"checkpointed region {region} is never recomputed: it was entered with grad "
               "enabled, but none of its inputs requires grad, so the reentrant checkpoint's "
               "output has no grad_fn and backward never reaches it; its trainable parameters "
               f"get no gradient: {listed}. Make an input require grad (e.g. "
               "hidden_states.requires_grad_() on a frozen embedding's output) or use the "
               "non-reentrant checkpoint (use_reentrant=False).")
    return RecomputeMismatchError(
        message, region=region, verdict=Verdict.NEVER_RECOMPUTED, item=listed,
        what=Divergence.UNLOCATED, position=None, op=None, forward_site=(), recompute_site=())
