"""How ``recompute_sanitizer()`` reaches the checkpoints it wraps: attribute patches that undo
only themselves (``_Patch``; ``_ApplyPatch`` for an ``autograd.Function``'s ``apply``, noting
the caller's grad mode, which the function's forward cannot see), and the frame a suspended
non-reentrant checkpoint generator made (``_checkpoint_frame``)."""

from __future__ import annotations

import threading

import torch

__all__ = ["_ApplyPatch", "_Patch", "_apply", "_checkpoint_frame"]


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


class _ApplyPatch:
    """``cls.apply`` noting the caller's grad mode for ``wrap_function_forward`` (an
    ``autograd.Function``'s forward runs with grad disabled); removed only if still ours."""

    def __init__(self, cls):
        self.cls, original = cls, cls.apply

        def apply(*args, **kwargs):
            _apply.grad = torch.is_grad_enabled()
            return original(*args, **kwargs)

        self.wrapper = apply
        self.had = "apply" in cls.__dict__
        self.original = cls.__dict__.get("apply")
        cls.apply = apply

    def undo(self) -> None:
        if self.cls.__dict__.get("apply") is self.wrapper:
            if self.had:
                self.cls.apply = self.original
            else:
                del self.cls.apply


_apply = threading.local()
