"""What ``recompute_sanitizer()`` reports: the error, what of the region's result differs
(``Verdict``) and where the recompute first departs from its forward (``Divergence``)."""

from __future__ import annotations

import enum

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
