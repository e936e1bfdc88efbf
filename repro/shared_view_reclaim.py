"""Crash 2 — ``resize_(0)`` on a shared chunk view: the recompute reclaim frees memory a later
backward still reads (verl #7328; origin verl #5251, Megatron-LM #3221 / #5197).

The graph, as small as it gets, with the shape of verl's mHC + MTP crash:

1. ``h = proj(x)`` is the decoder output, ``[s, 2*hidden]`` (mHC's multistream).
2. ``contract = h * mix`` reads ``h`` in its backward (``MulBackward`` saves ``h`` to compute the
   grad of ``mix``) — verl's ``learned_output_contract``.
3. ``part = torch.chunk(h, 2, -1)[1]`` made viewless (``out.data = view.data``: ``_base`` is
   None, the storage is ``h``'s) goes through a *reentrant* activation checkpoint — the MTP layer.
4. ``loss = contract.sum() + mtp.sum()``. The checkpoint's node was created last, so its backward
   runs first; ``MulBackward`` runs after it.

Unfixed: verl's reclaim (``fixes.megatron.reclaim_baselines``: ``resize_(0)`` every
requires-grad checkpoint input) frees ``h``'s storage in step 4; ``MulBackward`` then reads a null
pointer: SIGSEGV on CPU, "an illegal memory access" on CUDA. Fixed: the alias-aware reclaim
(``fixes.megatron.apply_recompute_reclaim_patch``) defers the shared storage to the end of the
backward pass; the oracle (WrongResult otherwise) checks every gradient against a run with no
reclaim and that the shared input was deferred, not released.

Repros:
* ``shared-view-reclaim`` — torch only; the checkpoint is PyTorch's reentrant
  ``torch.utils.checkpoint.CheckpointFunction`` (same backward shape as megatron's).
* ``shared-view-reclaim-megatron`` — megatron-core's ``tensor_parallel.checkpoint`` and
  ``make_viewless_tensor``; on CPU through repro/harness/megatron_cpu.py's RNG shim, unshimmed on CUDA.
* ``run_megatron_mtp`` — not a repro but a finding (H200, megatron-core 0.19.2, 2026-11-30): a
  real GPT + MTP (local spec, full recompute) with the unsafe reclaim does NOT crash and its
  grads match; ``tests/test_recompute_reclaim.py`` keeps that finding under test.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from repro.harness.isolated import free_loopback_port
from repro.registry import Repro, Signature, WrongResult

VARIANTS = ("none", "unsafe", "mtp-skip", "alias-aware")


@dataclass(kw_only=True, slots=True, frozen=True)
class SharedViewConfig:
    seq_len: int = 16
    hidden: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def install_reclaim(variant: str, target: type | None = None) -> None:
    """Install one reclaim variant (``VARIANTS``) on ``target`` (megatron's CheckpointFunction
    when None); ``none`` removes whichever stackfix reclaim is installed."""
    from fixes.megatron import reclaim, reclaim_baselines

    if variant not in VARIANTS:
        raise ValueError(f"unknown reclaim variant {variant!r}; allowed: {VARIANTS}")
    if variant == "none":
        kind = reclaim.installed_reclaim(target)
        if kind is not None:
            reclaim.uninstall_backward_wrapper(kind, target)
    elif variant == "unsafe":
        reclaim_baselines.apply_unsafe_reclaim_patch(target)
    elif variant == "mtp-skip":
        reclaim_baselines.apply_mtp_skip_reclaim_patch(target)
    else:
        reclaim.apply_recompute_reclaim_patch(target)


class ViewlessAlias(torch.autograd.Function):
    """What megatron's ``make_viewless_tensor(keep_graph=True)`` does: a new tensor whose
    ``.data`` is the input's (``_base`` None, storage shared), gradient passed straight through."""

    @staticmethod
    def forward(ctx, inp):
        out = torch.empty((1,), dtype=inp.dtype, device=inp.device)
        out.data = inp.data
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class SharedViewModel(nn.Module):
    def __init__(self, cfg: SharedViewConfig):
        super().__init__()
        h = cfg.hidden
        self.proj = nn.Linear(h, 2 * h)  # decoder -> two streams
        self.mix = nn.Parameter(torch.linspace(0.5, 1.5, 2 * h))  # contract: reads h in backward
        self.mtp = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, h))  # checkpointed


def shared_view_step(
    model: SharedViewModel,
    x: torch.Tensor,
    checkpoint: Callable[..., torch.Tensor],
    make_viewless: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Forward + backward of the graph in the module docstring (grads land in ``model``)."""
    h = model.proj(x)
    contract = h * model.mix
    part = make_viewless(torch.chunk(h, 2, dim=-1)[1])
    mtp = checkpoint(model.mtp, part)
    del h, part  # as in a real model: only autograd holds them now
    (contract.sum() + mtp.square().mean()).backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _check_against_reference(got: dict, ref: dict) -> None:
    for name, g in ref.items():
        if not torch.allclose(got[name], g, rtol=1e-5, atol=1e-6):
            diff = (got[name] - g).abs().max().item()
            raise WrongResult(f"grad of {name} differs from the no-reclaim reference by {diff:g}")


def _run(
    fixed: bool,
    device: str,
    target: type,
    checkpoint: Callable,
    make_viewless: Callable,
    cfg: SharedViewConfig = SharedViewConfig(),
) -> None:
    from fixes.megatron import recompute_reclaim_events

    torch.manual_seed(cfg.seed)
    model = SharedViewModel(cfg).to(device)
    x = torch.randn(cfg.seq_len, cfg.hidden, device=device)

    install_reclaim("none", target)
    shared_view_step(model, x, checkpoint, make_viewless)
    reference = _grads(model)
    model.zero_grad(set_to_none=True)

    install_reclaim("alias-aware" if fixed else "unsafe", target)
    with recompute_reclaim_events() as events:
        shared_view_step(model, x, checkpoint, make_viewless)
        if device == "cuda":
            torch.cuda.synchronize()  # surface an asynchronous CUDA fault here
    install_reclaim("none", target)
    _check_against_reference(_grads(model), reference)
    if fixed:
        inputs = [e.action for e in events if e.role == "input"]
        if inputs[:1] != ["deferred"] or "released" in inputs:
            raise WrongResult(f"the shared chunk view was not deferred: {inputs}")


def run_torch(fixed: bool, device: str) -> None:
    """``shared-view-reclaim``: PyTorch's reentrant checkpoint, torch only."""
    import torch.utils.checkpoint as tcp

    def checkpoint(fn, *args):
        return tcp.checkpoint(fn, *args, use_reentrant=True)

    _run(fixed, device, tcp.CheckpointFunction, checkpoint, ViewlessAlias.apply)


# --- megatron-core ------------------------------------------------------------------------------


def setup_megatron(device: str, seed: int = 1234) -> None:
    """World size 1: the CPU RNG shim on CPU; on CUDA the real thing —
    ``initialize_model_parallel()`` and ``model_parallel_cuda_manual_seed``."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device == "cpu":
        from repro.harness.megatron_cpu import install_megatron_cpu_rng_shim

        install_megatron_cpu_rng_shim(force=True)
        backend = "gloo"
    else:
        torch.cuda.set_device(0)
        backend = "nccl"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_loopback_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def run_megatron(fixed: bool, device: str) -> None:
    """``shared-view-reclaim-megatron``: megatron-core's CheckpointFunction and
    ``make_viewless_tensor``."""
    from megatron.core import tensor_parallel
    from megatron.core.utils import make_viewless_tensor

    setup_megatron(device)

    def checkpoint(fn, *args):
        return tensor_parallel.checkpoint(fn, False, *args)

    def make_viewless(t):
        return make_viewless_tensor(inp=t, requires_grad=True, keep_graph=True)

    _run(fixed, device, tensor_parallel.random.CheckpointFunction, checkpoint, make_viewless)


def run_megatron_mtp(fixed: bool, device: str) -> None:
    """megatron-core GPT + MTP (local spec, full uniform recompute, world size 1), unsafe reclaim
    (``fixed=False``) or the fix, grads against no reclaim (WrongResult if they differ).

    Both 0.16.1 and 0.19.2 feed the MTP layer ``torch.chunk(hidden_states, 1 + offset)[offset]``
    made viewless: a chunk view of the decoder output reaches a checkpoint. Whether anything
    still reads that storage after the MTP checkpoint's backward decides whether it crashes.
    CUDA only: on CPU the local attention and the MTP loss tracker allocate on
    ``torch.cuda.current_device()`` (outside the one RNG shim we allow).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import CheckpointFunction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fixes.megatron import recompute_reclaim_events

    setup_megatron(device)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, mtp_num_layers=1,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=device == "cpu",
    )
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16,
        mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False),
    ).to(device)
    model.train()
    b, s = 2, 16
    ids = torch.randint(0, 128, (b, s), device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).tril().logical_not()
    labels = torch.randint(0, 128, (b, s), device=device)

    def step() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(ids, pos, mask, labels=labels).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()
                if p.grad is not None}

    install_reclaim("none", CheckpointFunction)
    reference = step()
    install_reclaim("alias-aware" if fixed else "unsafe", CheckpointFunction)
    with recompute_reclaim_events() as events:
        got = step()
    install_reclaim("none", CheckpointFunction)
    print("reclaim events:", [(e.action, e.role) for e in events])
    _check_against_reference(got, reference)


_CPU_CRASH = (
    Signature(signal=signal.SIGSEGV, devices=("cpu",)),
    Signature(exception="RuntimeError", message="storage of size 0"),
)
_CUDA_CRASH = (
    Signature(stderr="an illegal memory access", devices=("cuda",)),
)

REPROS = [
    Repro(
        name="shared-view-reclaim",
        summary="verl's resize_(0) reclaim frees a chunk view's storage another node still reads "
        "(torch reentrant checkpoint)",
        run=run_torch,
        signatures=_CPU_CRASH + _CUDA_CRASH,
        devices=("cpu", "cuda"),
        timeout=120.0,
        upstream="verl #7328; verl #5251; Megatron-LM #3221",
    ),
    Repro(
        name="shared-view-reclaim-megatron",
        summary="the same with megatron-core's CheckpointFunction and make_viewless_tensor",
        run=run_megatron,
        signatures=_CPU_CRASH + _CUDA_CRASH,
        devices=("cpu", "cuda"),
        requires=("megatron",),
        timeout=180.0,
        upstream="verl #7328; verl #5251; Megatron-LM #3221",
    ),
]
