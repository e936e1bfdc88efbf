"""A Megatron-LM checkout (``dev`` branch) imported as ``megatron``: mHC exists only there.

No megatron-core release (through 0.19.2) has hyper-connections with MTP (``mhc_multistream``,
Megatron-LM #4518); Megatron-LM's ``dev`` branch does. ``STACKFIX_MEGATRON_LM`` names a checkout
of it; unset, the repros and tests that need it skip with that reason. Pinned and tested:
``dev`` at d48bd6be (2026-08-21)::

    git clone -b dev https://github.com/NVIDIA/Megatron-LM
    git -C Megatron-LM checkout d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1
    export STACKFIX_MEGATRON_LM=$PWD/Megatron-LM

``use_megatron_lm_checkout()`` puts the checkout first on ``sys.path`` of the calling (child)
process, so ``megatron.core`` resolves to it and not to an installed megatron-core release.
Only ``megatron/core`` of the checkout is imported.

``install_local_spec_nd_wgrad_workaround()``: on that dev commit the local (non-TransformerEngine)
spec cannot run backward through an mHC MTP layer. ``MultiTokenPredictionLayer._concat_embeddings``
applies ``h_proj`` (a ``ColumnParallelLinear``) to 4-D ``[s, b, n, h]`` streams, and
``LinearWithGradAccumulationAndAsyncCommunication.backward`` flattens only 3-D inputs before its
weight-gradient GEMM (``prepare_input_tensors_for_wgrad_compute``), so ``grad_output.t()`` raises
"t() expects a tensor with <= 2 dimensions, but self is 4D" on CPU and CUDA alike (upstream
tests mHC + MTP end to end with TransformerEngine only). The workaround flattens every leading
dimension, as the helper does for 3-D; it touches nothing on the forward path.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

from repro.registry import Skipped

ENV_VAR = "STACKFIX_MEGATRON_LM"
PINNED_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
PINNED = f"Megatron-LM dev at {PINNED_COMMIT[:8]} (2026-08-21)"
_HOW = (
    f"git clone -b dev https://github.com/NVIDIA/Megatron-LM && "
    f"git -C Megatron-LM checkout {PINNED_COMMIT[:8]}"
)
_MTP_FILE = Path("megatron/core/transformer/multi_token_prediction.py")
_GPT_FILE = Path("megatron/core/models/gpt/gpt_model.py")


class MegatronLMCheckoutError(RuntimeError):
    """``STACKFIX_MEGATRON_LM`` is set but names no usable Megatron-LM dev checkout."""


def megatron_lm_checkout() -> Path | None:
    """The checkout ``STACKFIX_MEGATRON_LM`` names (None when unset or empty)."""
    value = os.environ.get(ENV_VAR, "").strip()
    return Path(value).expanduser().resolve() if value else None


def skip_reason() -> str | None:
    """Why the dev-branch scenarios cannot run here (None when the variable is set)."""
    if megatron_lm_checkout() is None:
        return f"{ENV_VAR} is not set (a Megatron-LM dev checkout; pinned: {PINNED}: {_HOW})"
    return None


def check_megatron_lm_checkout(path: Path) -> Path:
    """``path`` if it holds a Megatron-LM tree whose GPT postprocess and MTP block carry
    ``mhc_multistream``; MegatronLMCheckoutError naming the pinned commit otherwise. Reads the
    files only (nothing is imported)."""
    for rel in (_MTP_FILE, _GPT_FILE):
        f = path / rel
        if not f.is_file():
            raise MegatronLMCheckoutError(
                f"{ENV_VAR}={path}: no {rel} there; it must name a Megatron-LM checkout "
                f"(pinned: {PINNED}: {_HOW})"
            )
        if "mhc_multistream" not in f.read_text(encoding="utf-8", errors="replace"):
            raise MegatronLMCheckoutError(
                f"{ENV_VAR}={path}: {rel} has no mhc_multistream (hyper-connections + MTP); "
                f"check out the dev branch (pinned: {PINNED}: {_HOW})"
            )
    return path


def configured_checkout_error() -> str | None:
    """Why the checkout ``STACKFIX_MEGATRON_LM`` names is not one (None when unset, or when it
    is): its files are read, nothing is imported, so a caller checks before it starts a child."""
    path = megatron_lm_checkout()
    if path is None:
        return None
    try:
        check_megatron_lm_checkout(path)
    except MegatronLMCheckoutError as exc:
        return str(exc)
    return None


def checkout_commit(path: Path) -> str:
    """``git rev-parse HEAD`` of the checkout, or a note when it is not a git work tree."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not runnable)"
    return out.stdout.strip() if out.returncode == 0 else "unknown (not a git work tree)"


def use_megatron_lm_checkout() -> Path:
    """Make ``import megatron`` load the checkout ``STACKFIX_MEGATRON_LM`` names, and verify
    that the imported MTP block takes ``mhc_multistream``. Call it before anything imports
    megatron. Raises Skipped when the variable is unset, MegatronLMCheckoutError when the
    checkout lacks mHC or megatron was already imported from elsewhere."""
    path = megatron_lm_checkout()
    if path is None:
        raise Skipped(skip_reason())
    check_megatron_lm_checkout(path)
    loaded = sys.modules.get("megatron")
    if loaded is not None and not any(
        Path(p).resolve().is_relative_to(path) for p in getattr(loaded, "__path__", ())
    ):
        raise MegatronLMCheckoutError(
            f"megatron is already imported from {list(loaded.__path__)}; "
            f"use_megatron_lm_checkout() must run before any megatron import"
        )
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
        importlib.invalidate_caches()

    import megatron.core
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    if not Path(megatron.core.__file__).resolve().is_relative_to(path):
        raise MegatronLMCheckoutError(
            f"megatron.core resolved to {megatron.core.__file__}, not to {path}"
        )
    if "mhc_multistream" not in inspect.signature(MultiTokenPredictionBlock.forward).parameters:
        raise MegatronLMCheckoutError(
            f"{ENV_VAR}={path}: MultiTokenPredictionBlock.forward takes no mhc_multistream; "
            f"check out the dev branch (pinned: {PINNED}: {_HOW})"
        )
    return path


def install_local_spec_nd_wgrad_workaround() -> bool:
    """Let the local spec's linear layers take inputs of any rank in backward (see the module
    docstring). Idempotent; True if installed now."""
    from megatron.core.tensor_parallel import layers

    original = layers.prepare_input_tensors_for_wgrad_compute
    if getattr(original, "__stackfix_nd__", False):
        return False

    @functools.wraps(original)
    def prepare_input_tensors_for_wgrad_compute(grad_output, all_gathered_input):
        if grad_output.dim() > 3:
            grad_output = grad_output.reshape(-1, grad_output.shape[-1])
            all_gathered_input = all_gathered_input.reshape(-1, all_gathered_input.shape[-1])
        return original(grad_output, all_gathered_input)

    prepare_input_tensors_for_wgrad_compute.__stackfix_nd__ = True
    layers.prepare_input_tensors_for_wgrad_compute = prepare_input_tensors_for_wgrad_compute
    return True
