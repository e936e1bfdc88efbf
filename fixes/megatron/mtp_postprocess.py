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

verl replaces ``GPTModel._postprocess`` per model (``patch_postprocess`` in
verl/models/mcore/mtp_patch.py assigns ``model._postprocess``) with a copy of an older body:
verl 0.8.0's copy lacks the keywords dev's ``GPTModel.forward`` passes (``padding_mask``,
``mhc_multistream``, ``output_processor``...) and raises TypeError; the copy verl #7328 describes
took ``mhc_multistream`` and never passed it to ``self.mtp`` (the view error above); verl 0.9.x
forwards it. Rather than copying the body again, this module *wraps* whatever postprocess is
installed, on the class or on the instance: the wrapper accepts ``mhc_multistream``, hands it to
the wrapped one when that takes it, drops keywords the wrapped one does not declare when their
value is None (the same as not passing them), and makes sure the MTP call receives the streams —
only when given and only when the MTP block's ``forward`` declares that parameter. On releases
without mHC nothing is given and the wrapped postprocess runs unchanged (bit-identical results;
tests/test_mtp_postprocess.py).

The MTP call is reached through a forward pre-hook on ``self.mtp`` for the duration of one
postprocess call, so the wrapped body runs as shipped. ``apply_mtp_postprocess_patch`` installs a
data descriptor on the class, so a per-instance replacement assigned before or after it is
wrapped too. ``wrap_postprocess`` is torch-only; megatron is imported only by
``apply_mtp_postprocess_patch`` / ``remove_mtp_postprocess_patch`` when no class is given.
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


def _call_forwarding(self, postprocess: Callable, args, kwargs, mhc_multistream):
    """Call ``postprocess`` (bound to ``self``) so that ``self.mtp`` receives the streams."""
    try:
        params = inspect.signature(postprocess).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None:
        if accepts_kwarg(postprocess, MHC_KWARG):
            # dev's own _postprocess (and verl 0.9.x's) forward it; the hook then sees it set.
            kwargs[MHC_KWARG] = mhc_multistream
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            # A copy of an older GPTModel._postprocess (verl 0.8.0's) lacks keywords that dev's
            # GPTModel.forward always passes; None is what the copy assumes when they are absent.
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k in params}
    with forwarding_mhc_multistream(getattr(self, "mtp", None), mhc_multistream):
        return postprocess(*args, **kwargs)


def _signature_with_mhc_kwarg(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature with a keyword-only ``mhc_multistream=None`` added if it lacks it, so
    callers that probe the signature (as dev's callers may) see the keyword."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if accepts_kwarg(fn, MHC_KWARG):
        return sig
    extra = inspect.Parameter(MHC_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None)
    params = list(sig.parameters.values())
    tail = [p for p in params if p.kind is p.VAR_KEYWORD]
    head = [p for p in params if p.kind is not p.VAR_KEYWORD]
    return sig.replace(parameters=[*head, extra, *tail])


def wrap_postprocess(original: Callable) -> Callable:
    """``original`` (a ``GPTModel._postprocess``-like method: ``self.mtp`` is the MTP block it
    calls) wrapped to accept and forward ``mhc_multistream``. Wrapping a wrapper returns it."""
    if getattr(original, _WRAPPED_MARK, False):
        return original

    @functools.wraps(original)
    def _postprocess(self, *args, mhc_multistream=None, **kwargs):
        bound = functools.partial(original, self)
        return _call_forwarding(self, bound, args, kwargs, mhc_multistream)

    # functools.wraps makes inspect.signature report the original's parameters: state ours.
    _postprocess.__signature__ = _signature_with_mhc_kwarg(original)
    setattr(_postprocess, _WRAPPED_MARK, True)
    return _postprocess


def _wrap_instance_postprocess(obj, replaced: Callable) -> Callable:
    """A per-instance ``_postprocess`` (already bound, as verl assigns it) wrapped for ``obj``."""

    def _postprocess(*args, mhc_multistream=None, **kwargs):
        return _call_forwarding(obj, replaced, args, kwargs, mhc_multistream)

    _postprocess.__wrapped__ = replaced
    _postprocess.__signature__ = _signature_with_mhc_kwarg(replaced)
    _postprocess._stackfix_replaced = replaced
    setattr(_postprocess, _WRAPPED_MARK, True)
    return _postprocess


class _ForwardingPostprocess:
    """What ``apply_mtp_postprocess_patch`` installs as ``cls._postprocess``. A *data*
    descriptor: an instance attribute (verl's ``model._postprocess = ...``) would shadow a plain
    class attribute; this one stores the assignment and still returns it wrapped."""

    def __init__(self, original: Callable, inherited: bool):
        self.original = original  # restored by remove_mtp_postprocess_patch
        self.inherited = inherited  # then deleted instead: the class had no own _postprocess
        self.wrapper = wrap_postprocess(original)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self.wrapper
        replaced = obj.__dict__.get("_postprocess")
        if replaced is None:
            return self.wrapper.__get__(obj, objtype)
        return _wrap_instance_postprocess(obj, replaced)

    def __set__(self, obj, value):
        if getattr(value, _WRAPPED_MARK, False):
            # Restoring a backup taken through this descriptor (verl's unpatch_postprocess):
            # store what it wrapped, not the wrapper (None: the class's own again).
            value = getattr(value, "_stackfix_replaced", None)
        if value is None:
            obj.__dict__.pop("_postprocess", None)
        else:
            obj.__dict__["_postprocess"] = value

    def __delete__(self, obj):
        obj.__dict__.pop("_postprocess", None)


def _gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel  # optional dependency

    return GPTModel


def is_mtp_postprocess_patched(cls: type | None = None) -> bool:
    """True if ``cls._postprocess`` (own or inherited) is the forwarding wrapper."""
    cls = cls if cls is not None else _gpt_model_class()
    return getattr(getattr(cls, "_postprocess", None), _WRAPPED_MARK, False)


def apply_mtp_postprocess_patch(cls: type | None = None) -> bool:
    """Install the forwarding wrapper as ``cls._postprocess`` (default: megatron-core's
    GPTModel), around the class's postprocess and around any per-instance replacement (verl's
    ``patch_postprocess``), whether that is assigned before or after. Idempotent; returns True
    if it installed the wrapper now, False if it was already there."""
    cls = cls if cls is not None else _gpt_model_class()
    if is_mtp_postprocess_patched(cls):
        return False
    inherited = "_postprocess" not in cls.__dict__
    cls._postprocess = _ForwardingPostprocess(cls._postprocess, inherited)
    return True


def remove_mtp_postprocess_patch(cls: type | None = None) -> bool:
    """Undo ``apply_mtp_postprocess_patch``. Idempotent; True if it removed a wrapper.
    Per-instance replacements stay assigned (as plain instance attributes again)."""
    cls = cls if cls is not None else _gpt_model_class()
    installed = cls.__dict__.get("_postprocess")
    if not isinstance(installed, _ForwardingPostprocess):
        return False  # not patched here (or patched on a base class: undo it there)
    if installed.inherited:
        delattr(cls, "_postprocess")
    else:
        cls._postprocess = installed.original
    return True
