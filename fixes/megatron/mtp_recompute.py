"""MTP with full recompute on megatron-core 0.18.0 / 0.18.2: ``MultiTokenPredictionLayer.forward``
passes ``padding_mask=`` to its own ``_checkpointed_forward``, whose signature has no such
parameter, so every training step with ``recompute_granularity="full"`` and MTP raises
``TypeError: ...._checkpointed_forward() got an unexpected keyword argument 'padding_mask'``
(verl #7326, Megatron-LM #4933). 0.17.1 passes no padding mask there; 0.19.0+ takes it and
checkpoints it as a tensor input.

The fix: ``_checkpointed_forward`` of such a release takes ``padding_mask`` and, when it is
None -- GPTModel's default, and what verl's Megatron engine passes -- calls megatron's own
without it, which is exactly what megatron's own recompute would compute then (its
``_proj_and_transformer_layer`` defaults ``padding_mask`` to None, in the forward and the
recompute alike). A padding mask that is a tensor cannot be carried into the recompute without
replacing megatron's checkpoint call (its ``custom_forward`` has no slot for it), and dropping it
would change the MoE router's aux loss silently; so that call raises ``MTPRecomputeRefused``
naming the releases and the way out (0.17.1 or 0.19.x, or ``recompute_granularity`` other than
"full" for the MTP layer). On releases whose ``_checkpointed_forward`` already takes
``padding_mask`` (or whose ``forward`` never passes it) the patch does nothing.
"""

from __future__ import annotations

import functools
import inspect
import threading

__all__ = ["AFFECTED_RELEASES", "MTPRecomputeRefused", "apply_mtp_recompute_patch",
           "mtp_recompute_needs_patch", "remove_mtp_recompute_patch"]

AFFECTED_RELEASES = ("0.18.0", "0.18.2")
_MARK = "__stackfix_mtp_recompute__"
_lock = threading.Lock()


class MTPRecomputeRefused(TypeError):
    """A padding mask with MTP + full recompute on a release that cannot checkpoint it."""


def _layer_class():
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return MultiTokenPredictionLayer


def mtp_recompute_needs_patch(cls: type | None = None) -> bool:
    """True where ``forward`` passes ``padding_mask`` to a ``_checkpointed_forward`` without it
    (megatron-core 0.18.0 / 0.18.2)."""
    cls = _layer_class() if cls is None else cls
    checkpointed = vars(cls).get("_checkpointed_forward")
    if checkpointed is None or getattr(checkpointed, _MARK, False):
        return False
    return ("padding_mask" in inspect.signature(cls.forward).parameters
            and "padding_mask" not in inspect.signature(checkpointed).parameters)


def _taking_padding_mask(checkpointed_forward):
    @functools.wraps(checkpointed_forward)
    def checkpointed_forward_taking_padding_mask(self, *args, padding_mask=None, **kwargs):
        if padding_mask is not None:
            from megatron.core import __version__

            raise MTPRecomputeRefused(
                f"megatron-core {__version__}: MTP with recompute_granularity='full' cannot carry "
                "a padding_mask into its recompute on megatron-core "
                f"{' / '.join(AFFECTED_RELEASES)} (MultiTokenPredictionLayer._checkpointed_forward "
                "has no padding_mask; Megatron-LM #4933, verl #7326), and dropping it would change "
                "the MoE aux loss. Use megatron-core 0.17.1 or 0.19.x, or pass no padding_mask.")
        return checkpointed_forward(self, *args, **kwargs)

    setattr(checkpointed_forward_taking_padding_mask, _MARK, True)
    return checkpointed_forward_taking_padding_mask


def apply_mtp_recompute_patch(cls: type | None = None) -> bool:
    """Let megatron-core 0.18.x's ``MultiTokenPredictionLayer._checkpointed_forward`` take the
    ``padding_mask`` its ``forward`` passes. False where nothing needs it or it is installed."""
    cls = _layer_class() if cls is None else cls
    with _lock:
        if not mtp_recompute_needs_patch(cls):
            return False
        cls._checkpointed_forward = _taking_padding_mask(vars(cls)["_checkpointed_forward"])
        return True


def remove_mtp_recompute_patch(cls: type | None = None) -> bool:
    """Put megatron's own ``_checkpointed_forward`` back. False when the patch was not on."""
    cls = _layer_class() if cls is None else cls
    with _lock:
        current = vars(cls).get("_checkpointed_forward")
        if not getattr(current, _MARK, False):
            return False
        cls._checkpointed_forward = current.__wrapped__
        return True
