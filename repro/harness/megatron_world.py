"""megatron-core at world size 1 (or one rank of an expert-parallel group) for the repros,
tests and benchmarks that build megatron's checkpoints and models: the process group, model
parallel state and RNG, with ``fixes.testing.megatron_cpu``'s shims on CPU."""

from __future__ import annotations

import os

import torch

__all__ = ["setup_megatron"]


def setup_megatron(device: str, seed: int = 1234, expert_parallel: int = 1) -> None:
    """World size 1: the CPU RNG, memory-buffer and stream shims on CPU; on CUDA the real thing —
    ``initialize_model_parallel()`` and ``model_parallel_cuda_manual_seed``.

    ``expert_parallel`` > 1: this process is one rank of a torchrun-style group (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / PORT in the environment; one GPU per rank on CUDA),
    and MoE experts are split over ``expert_parallel`` ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device == "cpu":
        from fixes.testing.megatron_cpu import (
            install_cpu_stream_shim,
            install_megatron_cpu_memory_buffer_shim,
            install_megatron_cpu_rng_shim,
        )

        install_megatron_cpu_rng_shim(force=True)
        install_megatron_cpu_memory_buffer_shim(force=True)  # the local spec's attention scratch
        install_cpu_stream_shim(force=True)  # for verl's reclaim
        backend = "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if expert_parallel > 1 else 0)
        backend = "nccl"
    if not dist.is_initialized():
        if expert_parallel > 1:
            dist.init_process_group(backend)  # the rank's environment (env://)
        else:
            # One rank needs no rendezvous: an in-process store, no port. A port probed free
            # and listened on later races every other process on the host (eleven H200
            # sessions side by side lost one to EADDRINUSE), and env:// through os.environ
            # handed the port to every child this process started. A MASTER_PORT given is used.
            if os.environ.get("MASTER_PORT"):
                addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
                dist.init_process_group(backend, rank=0, world_size=1,
                                        init_method=f"tcp://{addr}:{os.environ['MASTER_PORT']}")
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
