"""The one CUDA shim module of this project: where megatron-core (and verl's reclaim, which
patches it) hard-code CUDA, on CPU. Installed with the fixes: users' own CPU tests get it
through ``fixes.testing.megatron_on_cpu()``; the harness's repros, tests and benchmarks install
the shims they need directly.

1. CUDA RNG bookkeeping (``install_megatron_cpu_rng_shim``).

Why: megatron-core's ``tensor_parallel.random.CheckpointFunction.forward`` saves the CUDA RNG
state unconditionally (``_get_all_rng_states`` -> ``_get_cuda_rng_state``) and its backward
restores it (``_set_cuda_rng_state``), and ``get_cuda_rng_tracker()`` seeds CUDA generators.
On a machine without CUDA every checkpoint therefore raises before any of the behaviour under
test runs. The shim replaces exactly those two RNG
state accessors with CPU-safe ones and installs megatron's own *inference* RNG tracker
(which keeps no CUDA state). Nothing else of megatron is touched: checkpointing, recompute,
``make_viewless_tensor`` and the models run as shipped. It is a no-op where CUDA exists.

2. CUDA streams in verl's recompute reclaim (``install_cpu_stream_shim``).

Why: verl's reclaim (``apply_patch_megatron_recomputation_backward`` in
``verl/models/mcore/patch.py``, 0.8.0 / 0.9.1) calls ``torch.cuda.current_stream()`` and
``Tensor.record_stream(stream)`` before each ``resize_(0)``; on CPU the first raises "Torch not
compiled with CUDA enabled" and the second has no CPU kernel. A CPU has no streams to order:
``current_stream()`` returns ``torch.Stream("cpu")`` and ``record_stream`` on a CPU tensor does
nothing. verl's ``resize_(0)`` — the behaviour under test — runs as released.

3. ``GlobalMemoryBuffer`` (``install_megatron_cpu_memory_buffer_shim``): the local spec's
   attention asks it for scratch tensors, which it allocates on ``torch.cuda.current_device()``.

4. NVTX ranges (``install_nvtx_cpu_shim``): Megatron-LM dev's hyper-connection module opens
   ``torch.cuda.nvtx.range(...)`` unconditionally; a CPU-only torch build ships a stub there that
   raises "NVTX functions not installed". The shim makes those calls no-ops (what NVTX is without
   a profiler attached); nothing of megatron is touched.

5. megatron-core's MoE router on CPU (``install_megatron_cpu_moe_shim``): ``TopKRouter.gating``
   moves a CPU router weight to ``torch.cuda.current_device()`` and the router allocates its
   aux-loss scalars there (0.16.1 and 0.19.2); on a CPU-only torch build that call raises, and
   the shim makes it name the CPU. And megatron-core 0.16.1's ``RouterGatingLinearFunction``
   (``transformer/moe/moe_utils.py``, forward and backward) reads the module global
   ``te_general_gemm``, which that release binds only when Transformer Engine imports: without
   TE every MoE router call raises ``NameError`` on any device, CUDA included (H200,
   2026-12-01: verl's engine, MoE, its first ``train_batch``). No config field avoids it:
   ``TopKRouter.gating`` always calls ``router_gating_linear``, and the name is read before
   ``moe_router_dtype`` is. The shim binds it to ``None`` where it is missing -- on CPU and on
   CUDA -- which is what megatron-core 0.19 itself does without TE (its ``else:`` branch binds
   ``te_general_gemm = None``) and what the function's own fallback test (``te_general_gemm
   is not None``) expects: the router's torch ``mm`` / ``addmm`` path. The CPU device part
   (``current_device``) is only installed where CUDA is absent. Only where those calls would
   fail, and only in the processes that ask for it (the CPU cells of
   ``benchmarks.megatron_scale``; repro/verl_engine.py's CUDA training runs, without TE).
6. ``CheckpointWithoutOutput`` without Transformer Engine (``bind_missing_te_fp8_state``): the
   class sets ``self.fp8 = fp8 is not None``, so its default ``fp8=False`` takes the FP8 branch
   and ``CheckpointWithoutOutputFunction.forward`` reads ``FP8GlobalStateManager``, which
   ``tensor_parallel.random`` binds only when TE imports (0.16.1 through 0.19.2 and Megatron-LM
   main 19deef67): every selective "layernorm" / "moe_act" recompute raises ``NameError``
   without TE, on CPU and CUDA. The binding answers as TE does with FP8 off
   (``is_fp8_enabled()`` False, no recipe; ``activation_recompute_forward`` / ``fp8_autocast``
   contexts that do nothing). Bound only where the names are missing.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

_EMPTY_STATE = torch.empty(0, dtype=torch.uint8)
_stream_shim: torch.library.Library | None = None


def _get_cuda_rng_state(*args, **kwargs):
    return _EMPTY_STATE  # no CUDA generator to save


def _set_cuda_rng_state(*args, **kwargs):
    return None  # nothing to restore


def install_megatron_cpu_rng_shim(force: bool = False) -> bool:
    """Make megatron-core's checkpointing runnable on a CPU-only machine.

    Returns True if the shim was installed, False if CUDA is available (no shim needed)
    unless ``force``. Idempotent. Raises ImportError if megatron-core is not installed.
    """
    if torch.cuda.is_available() and not force:
        return False
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def install_megatron_cpu_memory_buffer_shim(force: bool = False) -> bool:
    """Let megatron's GlobalMemoryBuffer hand out CPU tensors on a CPU-only machine.

    Returns True if installed (or already installed), False if CUDA is available and not
    ``force``. Raises ImportError if megatron-core is not installed.
    """
    if torch.cuda.is_available() and not force:
        return False
    from megatron.core.utils import GlobalMemoryBuffer

    original = GlobalMemoryBuffer.get_tensor
    if getattr(original, "__stackfix_cpu_shim__", False):
        return True

    @functools.wraps(original)
    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        needed = math.prod(tensor_shape)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < needed:
            self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
        return original(self, tensor_shape, dtype, name, *args, **kwargs)

    get_tensor.__stackfix_cpu_shim__ = True
    GlobalMemoryBuffer.get_tensor = get_tensor
    return True


def bind_missing_te_general_gemm() -> bool:
    """``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` where the module did
    not bind it (megatron-core 0.16.1 without Transformer Engine), on any device. Returns True
    if it bound it now. Where TE bound it, or megatron-core binds it itself (0.19), a no-op."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


class _FP8Off:
    """What TE's ``FP8GlobalStateManager`` answers with FP8 off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def _no_fp8_context(*args, **kwargs):
    return contextlib.nullcontext()


def bind_missing_te_fp8_state() -> bool:
    """``megatron.core.tensor_parallel.random``'s TE names (``FP8GlobalStateManager``,
    ``activation_recompute_forward``, ``fp8_autocast``) bound to "FP8 off" where TE did not bind
    them. True if it bound them now."""
    from megatron.core.tensor_parallel import random as mrandom

    if hasattr(mrandom, "FP8GlobalStateManager"):
        return False
    mrandom.FP8GlobalStateManager = _FP8Off
    mrandom.activation_recompute_forward = _no_fp8_context
    mrandom.fp8_autocast = _no_fp8_context
    return True


def install_megatron_cpu_moe_shim() -> bool:
    """Megatron's MoE utilities get ``te_general_gemm = None`` where Transformer Engine did not
    bind it (on any device: ``bind_missing_te_general_gemm``), and on a CPU-only torch build
    ``torch.cuda.current_device()`` returns ``"cpu"`` instead of raising. Returns True if the
    CPU part is installed now or before, False where CUDA exists (the binding still happens)."""
    bind_missing_te_general_gemm()
    if torch.cuda.is_available():
        return False
    if getattr(torch.cuda.current_device, "__stackfix_cpu_shim__", False):
        return True

    def current_device() -> str:
        return "cpu"

    current_device.__stackfix_cpu_shim__ = True
    torch.cuda.current_device = current_device
    return True


class _NoNVTX:
    """``torch._C._nvtx``'s calls, doing nothing."""

    @staticmethod
    def rangePushA(msg):  # noqa: N802 - torch's names
        return 0

    @staticmethod
    def rangePop():  # noqa: N802
        return 0

    @staticmethod
    def rangeStartA(msg):  # noqa: N802
        return 0

    @staticmethod
    def rangeEnd(range_id):  # noqa: N802
        return None

    @staticmethod
    def markA(msg):  # noqa: N802
        return None


def install_nvtx_cpu_shim() -> bool:
    """Make ``torch.cuda.nvtx`` calls no-ops on a torch build without NVTX (CPU-only builds).
    Returns True if installed now or before, False where torch has NVTX (nothing to do)."""
    import torch.cuda.nvtx as nvtx

    if hasattr(torch._C, "_nvtx"):
        return False
    nvtx._nvtx = _NoNVTX()
    return True


def install_megatron_cpu_shims(force: bool = False) -> bool:
    """All shims: what a tiny megatron GPT (local spec) needs to run on CPU."""
    rng = install_megatron_cpu_rng_shim(force)
    buf = install_megatron_cpu_memory_buffer_shim(force)
    nvtx = install_nvtx_cpu_shim()
    return rng or buf or nvtx


def _cpu_current_stream(device=None) -> torch.Stream:
    return torch.Stream("cpu")


def _record_stream_on_cpu(tensor, stream) -> None:
    return None  # no streams on a CPU: nothing can reuse the block early


def install_cpu_stream_shim(force: bool = False) -> bool:
    """``torch.cuda.current_stream()`` -> ``torch.Stream("cpu")``; ``aten::record_stream`` gets
    a CPU kernel that does nothing. For verl's reclaim on a CPU-only machine.

    Returns True if installed (or already installed), False if CUDA is available and not
    ``force``. Process-wide and permanent: install it in a child process only.
    """
    global _stream_shim
    if torch.cuda.is_available() and not force:
        return False
    if _stream_shim is None:
        _stream_shim = torch.library.Library("aten", "IMPL")
        _stream_shim.impl("record_stream", _record_stream_on_cpu, "CPU")
        torch.cuda.current_stream = _cpu_current_stream
    return True
