"""Crash 2 — ``resize_(0)`` on a shared chunk view: the recompute reclaim frees memory a later
backward still reads (verl #7328; origin verl #5251, Megatron-LM #3221 / #5197).

The graph, as small as it gets, with the shape of verl's mHC + MTP crash:

1. ``h = proj(x)`` is the decoder output, ``[s, 2*hidden]`` (mHC's multistream).
2. ``contract = h * mix`` reads ``h`` in its backward (``MulBackward`` saves ``h`` to compute the
   grad of ``mix``) — mHC's ``learned_output_contract``.
3. ``part = torch.chunk(h, 2, -1)[1]`` made viewless (``out.data = view.data``: ``_base`` is
   None, the storage is ``h``'s) goes through a *reentrant* activation checkpoint — the MTP layer.
4. ``loss = contract.sum() + mtp.sum()``. The checkpoint's node was created last, so its backward
   runs first; ``MulBackward`` runs after it.

Unfixed: a reclaim that calls ``resize_(0)`` on every requires-grad checkpoint input frees ``h``'s
storage in step 4; ``MulBackward`` then reads a null pointer: SIGSEGV on CPU, "an illegal memory
access" on CUDA. Fixed: the reclaim (``fixes.megatron.apply_recompute_reclaim_patch``) makes the
recompute read its input through an identity node, so the leaked recompute graph holds none of
it, and resizes nothing: ``h``'s storage goes when ``MulBackward`` has read it; the oracle
(WrongResult otherwise) checks every gradient against a run with no reclaim, that the
recompute released its input, and that ``h``'s memory is gone after the step.
The ``-verl`` repros install the fix the way it meets verl in a verl process: verl's released
reclaim first (its Megatron engine's init), then ours, which replaces it.

Repros (the unfixed reclaim of the ``-verl`` ones is verl's released code, ``repro.verl_release``):

* ``shared-view-reclaim`` — torch only: PyTorch's reentrant checkpoint, and ``resize-all``, verl's
  reclaim mechanism put on it (verl's own patch can only target megatron-core's class).
* ``shared-view-reclaim-verl080`` — verl 0.8.0's ``apply_patch_megatron_recomputation_backward``
  on megatron-core's ``tensor_parallel.checkpoint`` / ``make_viewless_tensor``; the MTP checkpoint
  is made as Megatron-LM core_v0.19.0+ makes it (``custom_forward``, a closure over the layer).
* ``shared-view-reclaim-verl091`` — verl 0.9.1's patch, which skips a checkpoint when a closure
  cell of its ``run_function`` is an object of class ``MultiTokenPredictionLayer``. The MTP
  checkpoint is made as megatron-core 0.16.1 makes it — the newest release for Python 3.11, one
  verl 0.9.1's megatron engine runs on: ``MultiTokenPredictionLayer.forward`` passes the *bound
  method* ``self._proj_and_transformer_layer`` to ``_checkpointed_forward``, which hands it to
  ``tensor_parallel.checkpoint`` as is (megatron/core/transformer/multi_token_prediction.py,
  core_v0.16.1, ``forward`` and ``_checkpointed_forward``). A bound method has no closure, so
  the probe finds nothing and the MTP input is freed exactly as by 0.8.0. verl's own
  ``_patched_checkpointed_forward`` (verl/models/mcore/mtp_patch.py, 0.9.1; installed by
  ``patch_engine_mtp`` on that megatron) hides the layer too: its ``run`` closes over the bound
  method, not the layer (``mtp_checkpoint="verl-run"``). tests/test_verl_reclaim.py runs the
  installed megatron-core's own ``MultiTokenPredictionBlock`` the same way: a bound method and
  the crash on 0.16.1; a closure on core_v0.19.0+, where the skip does fire.
* ``run_megatron_mtp`` — not a repro but a finding (H200, megatron-core 0.19.2, 2026-11-30): a
  real GPT + MTP (local spec, full recompute) with verl's reclaim (then a re-creation of 0.8.0's,
  now the release itself) does NOT crash and its grads match;
  ``tests/test_recompute_reclaim.py`` keeps that finding under test.

On CPU, megatron and verl run through fixes/testing/megatron_cpu.py's RNG and stream shims.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from repro.harness.isolated import free_loopback_port
from repro.harness.leaks import ModuleStateLeak
from repro.registry import Repro, Signature, WrongResult

# none: no reclaim; resize-all: verl's mechanism on any reentrant checkpoint (torch's);
# verl-X: verl X's released patch (megatron-core's CheckpointFunction only); ours: the fix.
VERL_RECLAIMS = {"verl-0.8.0": "0.8.0", "verl-0.9.1": "0.9.1"}
VARIANTS = ("none", "resize-all", *VERL_RECLAIMS, "ours")
# How the MTP layer's checkpoint is made (megatron_mtp_checkpoint).
MTP_CHECKPOINTS = ("closure", "bound-method", "verl-run")


@dataclass(kw_only=True, slots=True, frozen=True)
class SharedViewConfig:
    seq_len: int = 16
    hidden: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# --- the reclaims -------------------------------------------------------------------------------


def _resize_all(backward: Callable) -> Callable:
    """verl's reclaim mechanism on any reentrant checkpoint: after the backward, ``resize_(0)``
    each requires-grad recompute input and its grad, handing back clones of the grads. Which
    tensors the recompute got is recorded by a pass-through ``ctx.run_function`` for the call."""
    from fixes.megatron.reclaim import ReclaimAction, emit
    from fixes.megatron.storage import storage_key

    @functools.wraps(backward)
    def resize_all_backward(ctx, *grad_outputs):
        calls, run_function = [], ctx.run_function

        def observed(*args, **kwargs):
            calls.append(args)
            return run_function(*args, **kwargs)

        ctx.run_function = observed
        try:
            result = backward(ctx, *grad_outputs)
        finally:
            ctx.run_function = run_function
        result = tuple(g.clone() if isinstance(g, torch.Tensor) else g for g in result)
        for t in calls[0] if len(calls) == 1 else ():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                emit(ReclaimAction.RESIZED, "input", storage_key(t),
                     t.untyped_storage().nbytes())
                t.untyped_storage().resize_(0)
                if t.grad is not None:
                    t.grad.untyped_storage().resize_(0)
        return result

    return resize_all_backward


def _megatron_checkpoint_function() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom.CheckpointFunction


def install_verl_reclaim(version: str) -> None:
    """verl ``version``'s ``apply_patch_megatron_recomputation_backward``, as released and as
    its Megatron engine calls it (it assigns megatron-core's ``CheckpointFunction.backward``)."""
    from repro.verl_release import import_verl

    import_verl(version, "verl.models.mcore.patch").apply_patch_megatron_recomputation_backward()


def install_reclaim(variant: str, target: type | None = None, over: str | None = None) -> None:
    """Install one reclaim variant (``VARIANTS``) on ``target`` (megatron's CheckpointFunction
    when None), after putting the module's own backward back; ``none`` only does that.

    ``over``: a verl variant installed first, as verl's Megatron engine installs it in its
    init; ``variant`` then meets it as it would in a verl process (ours replaces it)."""
    from fixes.megatron import reclaim

    for name in (variant, over or "none"):
        if name not in VARIANTS:
            raise ValueError(f"unknown reclaim variant {name!r}; allowed: {VARIANTS}")
    if over is not None and over not in VERL_RECLAIMS:
        raise ValueError(f"over= takes a verl reclaim, one of {tuple(VERL_RECLAIMS)}; got {over!r}")
    target = _megatron_checkpoint_function() if target is None else target
    reclaim.reset_backward(target)
    for name in (over, variant):
        if name in VERL_RECLAIMS:
            if target is not _megatron_checkpoint_function():
                raise ValueError("verl's reclaim patches megatron-core's CheckpointFunction only")
            install_verl_reclaim(VERL_RECLAIMS[name])
        elif name == "resize-all":
            reclaim.install_backward_wrapper("resize-all", _resize_all, target)
        elif name == "ours":
            with warnings.catch_warnings():
                if over is not None:  # "replaced verl's backward": what this order is about
                    warnings.simplefilter("ignore", RuntimeWarning)
                reclaim.apply_recompute_reclaim_patch(target)


# --- the graph ----------------------------------------------------------------------------------


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


class MultiTokenPredictionLayer(nn.Module):
    """The checkpointed MTP layer, named as megatron-core's is: the class name is all verl
    0.9.1's skip looks for. ``config`` holds what verl's ``_patched_checkpointed_forward`` reads."""

    def __init__(self, hidden: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        # The recompute leak the reclaim exists for (Megatron-LM #3221 / #5227): the layer
        # keeps its recompute output, and with it the checkpoint's detached input.
        self.leak = ModuleStateLeak()
        self.config = SimpleNamespace(fp8=False, distribute_saved_activations=False,
                                      recompute_method="uniform", recompute_num_layers=1)

    def _proj_and_transformer_layer(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.body(hidden_states)
        self.leak.keep(out)
        return out

    forward = _proj_and_transformer_layer


class SharedViewModel(nn.Module):
    def __init__(self, cfg: SharedViewConfig):
        super().__init__()
        h = cfg.hidden
        self.proj = nn.Linear(h, 2 * h)  # decoder -> two streams
        self.mix = nn.Parameter(torch.linspace(0.5, 1.5, 2 * h))  # contract: reads h in backward
        self.mtp = MultiTokenPredictionLayer(h)  # checkpointed


def shared_view_step(
    model: SharedViewModel,
    x: torch.Tensor,
    checkpoint: Callable[..., torch.Tensor],
    make_viewless: Callable[[torch.Tensor], torch.Tensor],
):
    """Forward + backward of the graph in the module docstring (grads land in ``model``);
    ``checkpoint(mtp_layer, part)`` runs the MTP layer under a reentrant checkpoint. Returns a
    weak reference to ``h``'s storage (``storage_gone`` tells whether its memory went)."""
    h = model.proj(x)
    weak_h = h.untyped_storage()._weak_ref()
    contract = h * model.mix
    part = make_viewless(torch.chunk(h, 2, dim=-1)[1])
    mtp = checkpoint(model.mtp, part)
    del h, part  # as in a real model: only autograd holds them now
    (contract.sum() + mtp.square().mean()).backward()
    return weak_h


def storage_gone(weak_storage) -> bool:
    """Has the storage behind ``weak_storage`` been freed (or shrunk to nothing)?"""
    if torch.UntypedStorage._expired(weak_storage):
        return True
    return torch.UntypedStorage._new_with_weak_ptr(weak_storage).nbytes() == 0


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _check_against_reference(got: dict, ref: dict) -> None:
    for name, g in ref.items():
        if not torch.allclose(got[name], g, rtol=1e-5, atol=1e-6):
            diff = (got[name] - g).abs().max().item()
            raise WrongResult(f"grad of {name} differs from the no-reclaim reference by {diff:g}")


def _run(
    variant: str,
    device: str,
    target: type,
    checkpoint: Callable,
    make_viewless: Callable,
    cfg: SharedViewConfig = SharedViewConfig(),
    over: str | None = None,
) -> None:
    """The step with no reclaim (the reference), then with ``variant`` (installed ``over`` a
    verl reclaim when given): grads must match; the fix must also have let the leak go — the
    shared storage freed by the end of the backward, no storage resized."""
    from fixes.megatron import recompute_reclaim_events

    torch.manual_seed(cfg.seed)
    model = SharedViewModel(cfg).to(device)
    x = torch.randn(cfg.seq_len, cfg.hidden, device=device)

    install_reclaim("none", target)
    shared_view_step(model, x, checkpoint, make_viewless)
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    model.mtp.leak.clear()

    install_reclaim(variant, target, over=over)
    with recompute_reclaim_events() as events:
        weak_h = shared_view_step(model, x, checkpoint, make_viewless)
        if device == "cuda":
            torch.cuda.synchronize()  # surface an asynchronous CUDA fault here
    install_reclaim("none", target)
    _check_against_reference(_grads(model), reference)
    if variant == "ours":
        # The leaked recompute graph holds nothing of the chunk view (its identity node's
        # stand-in only), so the shared storage went when its last reader (the contraction)
        # had run.
        print("reclaim events:", " ".join(f"{e.role}:{e.action}" for e in events), flush=True)
        inputs = [e.action for e in events if e.role == "input"]
        if inputs != ["released"]:
            raise WrongResult(f"the recompute did not release the chunk view: {inputs}")
        if not storage_gone(weak_h):
            raise WrongResult("the shared storage outlived the backward: the leak kept it")


def run_torch(fixed: bool, device: str) -> None:
    """``shared-view-reclaim``: PyTorch's reentrant checkpoint, torch only."""
    import torch.utils.checkpoint as tcp

    def checkpoint(fn, *args):
        return tcp.checkpoint(fn, *args, use_reentrant=True)

    variant = "ours" if fixed else "resize-all"
    _run(variant, device, tcp.CheckpointFunction, checkpoint, ViewlessAlias.apply)


# --- megatron-core ------------------------------------------------------------------------------


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
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_loopback_port()))
            dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_mtp_checkpoint(form: str) -> Callable[..., torch.Tensor]:
    """``checkpoint(layer, part)`` through megatron-core's ``tensor_parallel.checkpoint``, the
    ``run_function`` made as upstream makes it (``MTP_CHECKPOINTS``):

    * ``closure``: Megatron-LM core_v0.19.0+ ``MultiTokenPredictionLayer._checkpointed_forward``:
      ``custom_forward`` calls ``self._proj_and_transformer_layer`` (the layer is a closure cell);
    * ``bound-method``: megatron-core 0.16.1: ``forward`` passes the bound method
      ``self._proj_and_transformer_layer``; ``_checkpointed_forward`` hands it to
      ``tensor_parallel.checkpoint`` unchanged;
    * ``verl-run``: verl 0.9.1's ``_patched_checkpointed_forward`` (verl/models/mcore/mtp_patch.py)
      on that bound method — its ``run`` closes over the method and two spec lists.
    """
    from megatron.core import tensor_parallel

    if form not in MTP_CHECKPOINTS:
        raise ValueError(f"unknown MTP checkpoint form {form!r}; allowed: {MTP_CHECKPOINTS}")
    if form == "closure":
        def checkpoint(layer, part):
            def custom_forward(hidden_states):
                return layer._proj_and_transformer_layer(hidden_states)

            return tensor_parallel.checkpoint(custom_forward, False, part)
    elif form == "bound-method":
        def checkpoint(layer, part):
            return tensor_parallel.checkpoint(layer._proj_and_transformer_layer, False, part)
    else:
        from repro.verl_release import import_verl

        mtp_patch = import_verl("0.9.1", "verl.models.mcore.mtp_patch")

        def checkpoint(layer, part):
            return mtp_patch._patched_checkpointed_forward(
                layer, layer._proj_and_transformer_layer, hidden_states=part)
    return checkpoint


def run_verl(version: str, mtp_checkpoint: str, fixed: bool, device: str) -> None:
    """The graph through megatron-core, unfixed: verl ``version``'s released reclaim; fixed:
    the same installed first, then the fix over it. Skipped (repro.Skipped) where the verl
    release is not installed (``python -m repro.verl_release install``)."""
    from megatron.core import tensor_parallel
    from megatron.core.utils import make_viewless_tensor

    from repro.verl_release import require_release

    require_release(version)
    setup_megatron(device)

    def make_viewless(t):
        return make_viewless_tensor(inp=t, requires_grad=True, keep_graph=True)

    # Fixed: in the order of a verl process -- verl's reclaim installed first (its engine's init),
    # then ours, which replaces it.
    variant = "ours" if fixed else f"verl-{version}"
    _run(variant, device, tensor_parallel.random.CheckpointFunction,
         megatron_mtp_checkpoint(mtp_checkpoint), make_viewless,
         over=f"verl-{version}" if fixed else None)


def run_megatron_mtp(fixed: bool, device: str) -> None:
    """megatron-core GPT + MTP (local spec, full uniform recompute, world size 1), verl 0.8.0's
    reclaim (``fixed=False``) or the fix, grads against no reclaim (WrongResult if they differ).

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
    install_reclaim("ours" if fixed else "verl-0.8.0", CheckpointFunction)
    with recompute_reclaim_events() as events:
        got = step()
    install_reclaim("none", CheckpointFunction)
    print("reclaim events:", [(e.action, e.role) for e in events])
    _check_against_reference(got, reference)


_CPU_CRASH = (
    Signature(signal=signal.SIGSEGV, devices=("cpu",)),
    Signature(exception="RuntimeError", message="storage of size 0"),
)
# Under fixes.sanitize: named before the kernel runs, on CPU and CUDA alike.
_SANITIZED = (Signature(exception="ReleasedStorageError", message="would access freed memory"),)
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
        sanitized_signatures=_SANITIZED,
        devices=("cpu", "cuda"),
        timeout=120.0,
        upstream="verl #7328; verl #5251; Megatron-LM #3221",
    ),
    Repro(
        name="shared-view-reclaim-verl080",
        summary="verl 0.8.0's released reclaim on megatron-core: the MTP chunk view's storage "
        "freed under the contraction's backward",
        run=functools.partial(run_verl, "0.8.0", "closure"),
        signatures=_CPU_CRASH + _CUDA_CRASH,
        sanitized_signatures=_SANITIZED,
        devices=("cpu", "cuda"),
        requires=("megatron",),
        timeout=180.0,
        upstream="verl #7328; verl #5251; Megatron-LM #3221",
    ),
    Repro(
        name="shared-view-reclaim-verl091",
        summary="verl 0.9.1's MTP skip misses megatron-core 0.16.1's MTP checkpoint (a bound "
        "method, no closure): the same crash",
        run=functools.partial(run_verl, "0.9.1", "bound-method"),
        signatures=_CPU_CRASH + _CUDA_CRASH,
        sanitized_signatures=_SANITIZED,
        devices=("cpu", "cuda"),
        requires=("megatron",),
        timeout=180.0,
        upstream="verl #7328 (the MTP skip); megatron-core 0.16.1 multi_token_prediction.py",
    ),
]
