"""Helpers for your own CPU regression tests of the megatron fixes; the pytest fixtures that
wrap them are in ``fixes.testing.pytest_plugin`` (registered through the ``pytest11`` entry
point ``stackfix-testing``: installing stackfix-harness makes them available in any pytest run).

megatron-core's ``tensor_parallel.checkpoint`` saves and restores the CUDA RNG state on every
call, so on a CPU-only machine it raises "Torch not compiled with CUDA enabled" before the
reclaim (or anything else under test) runs. ``megatron_on_cpu()`` installs the CPU shims of
``fixes.testing.megatron_cpu`` (the one CUDA shim module: CUDA RNG state get/set as no-ops with
megatron's inference RNG tracker, ``GlobalMemoryBuffer`` on CPU, NVTX as no-ops; where CUDA
exists, nothing) for a block and puts megatron's originals back after; checkpointing and
recompute run as shipped::

    from fixes.testing import megatron_on_cpu, recompute_reclaim

    with megatron_on_cpu(), recompute_reclaim() as events:   # or the pytest fixtures
        ...

Importing this package imports neither torch nor megatron (nor pytest) until a helper is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["megatron_on_cpu", "recompute_reclaim"]


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """megatron-core's checkpointing runnable on a CPU-only machine inside the block (a no-op
    where CUDA is available). Raises ImportError when megatron-core is not installed."""
    import torch

    from fixes.testing import megatron_cpu

    if torch.cuda.is_available():
        yield
        return
    import torch.cuda.nvtx as nvtx
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    saved = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state,
             mrandom._CUDA_RNG_STATE_TRACKER, GlobalMemoryBuffer.get_tensor, nvtx._nvtx)
    megatron_cpu.install_megatron_cpu_shims()
    try:
        yield
    finally:
        (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state,
         mrandom._CUDA_RNG_STATE_TRACKER, GlobalMemoryBuffer.get_tensor, nvtx._nvtx) = saved


@contextlib.contextmanager
def recompute_reclaim() -> Iterator[list]:
    """``apply_recompute_reclaim_patch()`` for the block (removed after unless it was already
    installed), yielding the ``ReclaimEvent`` s recorded meanwhile."""
    from fixes.megatron import (
        apply_recompute_reclaim_patch,
        recompute_reclaim_events,
        remove_recompute_reclaim_patch,
    )

    installed = apply_recompute_reclaim_patch()
    try:
        with recompute_reclaim_events() as events:
            yield events
    finally:
        if installed:
            remove_recompute_reclaim_patch()
