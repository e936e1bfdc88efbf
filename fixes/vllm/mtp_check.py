"""vLLM's MTP checkpoint-completeness check, switched off for bucketed refit loads.

vLLM (0.27+; ``model_executor/model_loader/mtp_validation.py``) has MTP models' ``load_weights``
raise "MTP ... weights missing from checkpoint" unless every MTP weight arrived in that call. An
RL refit streams weights in buckets, so each bucket looks incomplete; vLLM's own weight-transfer
engines load under ``disable_mtp_completeness_check()`` (a ContextVar, so scoped to the current
thread / task). verl #7328 does the same, with a nullcontext on older vLLM, which has no check.
"""

from __future__ import annotations

import contextlib
import importlib

_MTP_VALIDATION = "vllm.model_executor.model_loader.mtp_validation"


def _mtp_validation():
    try:
        return importlib.import_module(_MTP_VALIDATION)
    except ImportError:
        return None


def has_mtp_completeness_check() -> bool:
    """True if this vLLM has the scoped MTP completeness check (0.27+)."""
    mod = _mtp_validation()
    return mod is not None and hasattr(mod, "disable_mtp_completeness_check")


def mtp_completeness_check_disabled() -> contextlib.AbstractContextManager:
    """A context manager: vLLM's ``disable_mtp_completeness_check()`` where it exists, else a
    ``nullcontext`` (older vLLM, or none installed)."""
    mod = _mtp_validation()
    disable = getattr(mod, "disable_mtp_completeness_check", None) if mod is not None else None
    return disable() if disable is not None else contextlib.nullcontext()
