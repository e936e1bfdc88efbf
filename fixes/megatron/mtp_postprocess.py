"""Forward ``mhc_multistream`` from GPTModel's postprocess to the MTP block (crash 3).

The data contract on Megatron-LM's ``dev`` branch (the only place mHC exists; no megatron-core
release through 0.19.2 has it; read at dev d48bd6be, 2026-08-21):

- ``TransformerBlock.postprocess_for_layer_schedule`` (megatron/core/transformer/
  transformer_block.py) keeps the pre-contraction streams ``[s, b, n*h]`` when mHC and MTP are
  both on, contracts them with ``learned_output_contract`` to ``[s, b, h]``, and
  ``TransformerBlock.forward`` returns ``(contracted, mhc_multistream)``.
- ``GPTModel.forward`` (megatron/core/models/gpt/gpt_model.py) unpacks that tuple and calls
  ``self._postprocess(..., mhc_multistream=mhc_multistream)``, which passes it on to
  ``self.mtp(..., mhc_multistream=mhc_multistream)``.
- ``MultiTokenPredictionBlock.forward`` (megatron/core/transformer/multi_token_prediction.py)
  feeds its depths from ``torch.chunk(mhc_multistream, ...)`` when it is given, else from the
  contracted ``hidden_states``; in mHC mode ``MultiTokenPredictionLayer._concat_embeddings``
  does ``hidden_states.view(s, b, n, h)``, which fails on contracted ``[s, b, h]`` states:
  ``RuntimeError: shape '[s, b, n, h]' is invalid for input of size s*b*h``.

verl replaced ``GPTModel._postprocess`` with a copy that accepted ``mhc_multistream`` but never
passed it to ``self.mtp`` (verl #7328 fixed the copy). Rather than copying the body again, this
module *wraps* whatever ``_postprocess`` is installed: the wrapper accepts ``mhc_multistream``,
hands it to the original when the original takes it, and makes sure the MTP call receives it —
only when it is given and only when the installed MTP block's ``forward`` declares that
parameter. On releases without mHC the decoder never returns a tuple, nothing is given, and
the wrapper calls the original unchanged (bit-identical results; tests/test_mtp_postprocess.py).

The MTP call is reached through a forward pre-hook on ``self.mtp`` for the duration of one
postprocess call, so the original body runs as shipped. ``wrap_postprocess`` is torch-only and
is what ``repro/mtp_shape.py`` uses for its fixed path; megatron is imported only by
``apply_mtp_postprocess_patch`` / ``remove_mtp_postprocess_patch``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator

import torch

MHC_KWARG = "mhc_multistream"
_WRAPPED_MARK = "_stackfix_forwards_mhc_multistream"


def accepts_kwarg(fn: Callable, name: str) -> bool:
    """True if ``fn`` declares a parameter called ``name`` (positional-or-keyword or
    keyword-only). A bare ``**kwargs`` does not count: an MTP block that merely spreads its
    kwargs into its layers (as megatron-core releases do with ``extra_block_kwargs``) would pass
    the tensor somewhere that does not expect it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C callables without a signature
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def mtp_accepts_multistream(mtp: torch.nn.Module | None) -> bool:
    """True if ``mtp``'s forward takes ``mhc_multistream`` (Megatron-LM dev's
    MultiTokenPredictionBlock.forward does; every megatron-core release through 0.19.2 does not)."""
    return isinstance(mtp, torch.nn.Module) and accepts_kwarg(mtp.forward, MHC_KWARG)


@contextlib.contextmanager
def forwarding_mhc_multistream(
    mtp: torch.nn.Module | None, mhc_multistream: torch.Tensor | None
) -> Iterator[bool]:
    """While active, every call of ``mtp`` receives ``mhc_multistream=...`` unless the caller
    already passed a non-None one. Yields whether forwarding is in effect: False when nothing is
    given (releases without mHC) or when ``mtp`` does not accept it (then the tensor is dropped
    with a RuntimeWarning, because an mHC decoder paired with such an MTP cannot work)."""
    if mhc_multistream is None or mtp is None:
        yield False
        return
    if not mtp_accepts_multistream(mtp):
        warnings.warn(
            f"{type(mtp).__name__}.forward has no '{MHC_KWARG}' parameter; the multi-stream "
            "decoder output is not forwarded to MTP (installed MTP has no mHC path)",
            RuntimeWarning,
            stacklevel=3,
        )
        yield False
        return

    def _inject(module, args, kwargs):
        if kwargs.get(MHC_KWARG) is None:
            kwargs[MHC_KWARG] = mhc_multistream
        return args, kwargs

    handle = mtp.register_forward_pre_hook(_inject, with_kwargs=True)
    try:
        yield True
    finally:
        handle.remove()


def wrap_postprocess(original: Callable) -> Callable:
    """``original`` (a ``GPTModel._postprocess``-like method: ``self.mtp`` is the MTP block it
    calls) wrapped to accept and forward ``mhc_multistream``. Wrapping a wrapper returns it."""
    if getattr(original, _WRAPPED_MARK, False):
        return original
    passes_through = accepts_kwarg(original, MHC_KWARG)

    @functools.wraps(original)
    def _postprocess(self, *args, mhc_multistream=None, **kwargs):
        if passes_through:
            # dev's own _postprocess forwards it itself; the hook below then sees it already set.
            kwargs[MHC_KWARG] = mhc_multistream
        with forwarding_mhc_multistream(getattr(self, "mtp", None), mhc_multistream):
            return original(self, *args, **kwargs)

    # functools.wraps makes inspect.signature report the original's parameters; state the
    # accepted keyword too, so callers that probe the signature (as dev's callers may) see it.
    sig = inspect.signature(original)
    if not passes_through:
        extra = inspect.Parameter(MHC_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None)
        params = list(sig.parameters.values())
        tail = [p for p in params if p.kind is p.VAR_KEYWORD]
        head = [p for p in params if p.kind is not p.VAR_KEYWORD]
        sig = sig.replace(parameters=[*head, extra, *tail])
    _postprocess.__signature__ = sig
    setattr(_postprocess, _WRAPPED_MARK, True)
    return _postprocess


def _gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel  # optional dependency

    return GPTModel


def is_mtp_postprocess_patched(cls: type | None = None) -> bool:
    """True if ``cls._postprocess`` (own or inherited) is the forwarding wrapper."""
    cls = cls if cls is not None else _gpt_model_class()
    return getattr(getattr(cls, "_postprocess", None), _WRAPPED_MARK, False)


def apply_mtp_postprocess_patch(cls: type | None = None) -> bool:
    """Wrap ``cls._postprocess`` (default: megatron-core's GPTModel) with ``wrap_postprocess``.
    Idempotent; returns True if it installed the wrapper now, False if it was already there.
    Apply it after any other patch that replaces ``_postprocess`` (e.g. verl's), so that the
    wrapper sits outermost."""
    cls = cls if cls is not None else _gpt_model_class()
    if is_mtp_postprocess_patched(cls):
        return False
    inherited = "_postprocess" not in cls.__dict__
    wrapper = wrap_postprocess(cls._postprocess)
    wrapper._stackfix_inherited = inherited  # removal deletes instead of restoring
    cls._postprocess = wrapper
    return True


def remove_mtp_postprocess_patch(cls: type | None = None) -> bool:
    """Undo ``apply_mtp_postprocess_patch``. Idempotent; True if it removed a wrapper."""
    cls = cls if cls is not None else _gpt_model_class()
    wrapper = cls.__dict__.get("_postprocess")
    if not getattr(wrapper, _WRAPPED_MARK, False):
        return False  # not patched here (or patched on a base class: undo it there)
    if getattr(wrapper, "_stackfix_inherited", False):
        delattr(cls, "_postprocess")
    else:
        cls._postprocess = wrapper.__wrapped__
    return True
