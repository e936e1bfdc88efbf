"""Helpers for your own CPU regression tests of the megatron fixes, and the pytest fixtures that
wrap them (registered through the ``pytest11`` entry point ``stackfix-testing``: installing
stackfix-harness makes them available in any pytest run).

megatron-core's ``tensor_parallel.checkpoint`` saves and restores the CUDA RNG state on every
call, so on a CPU-only machine it raises "Torch not compiled with CUDA enabled" before the
reclaim (or anything else under test) runs. ``megatron_on_cpu()`` installs the CPU shims of
``repro.harness.megatron_cpu`` (CUDA RNG state get/set as no-ops with megatron's inference RNG
tracker, ``GlobalMemoryBuffer`` on CPU, NVTX as no-ops; where CUDA exists, nothing) for a block
and puts megatron's originals back after; checkpointing and recompute run as shipped::

    from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
    from repro.testing import megatron_on_cpu, recompute_reclaim

    with megatron_on_cpu(), recompute_reclaim():          # or the pytest fixtures below
        ...

Fixtures (each skips its test when megatron-core is not installed):

- ``megatron_cpu``: ``megatron_on_cpu()`` around the test; yields ``megatron.core.tensor_parallel``.
- ``megatron_recompute_reclaim``: also ``fixes.megatron.apply_recompute_reclaim_patch()`` for the
  test (removed after when the fixture installed it) inside
  ``fixes.megatron.recompute_reclaim_events()``; yields the list of ``ReclaimEvent`` s it records.

This module imports neither torch nor megatron until a helper is used (pytest loads it at start).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """megatron-core's checkpointing runnable on a CPU-only machine inside the block (a no-op
    where CUDA is available). Raises ImportError when megatron-core is not installed."""
    import torch

    from repro.harness import megatron_cpu

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


@pytest.fixture
def megatron_cpu():
    """megatron-core's checkpointing on CPU for this test; yields megatron.core.tensor_parallel."""
    tensor_parallel = pytest.importorskip("megatron.core.tensor_parallel")
    with megatron_on_cpu():
        yield tensor_parallel


@pytest.fixture
def megatron_recompute_reclaim(megatron_cpu):
    """fixes.megatron's recompute reclaim installed for this test; yields its ReclaimEvents."""
    with recompute_reclaim() as events:
        yield events
