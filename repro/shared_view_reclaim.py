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
access" on CUDA. Fixed: the reclaim (``fixes.megatron.apply_recompute_reclaim_patch``) lets the
recompute's detached copy, which only the leaked recompute graph holds, go of the input's memory
after the backward, and resizes nothing: ``h``'s storage goes when ``MulBackward`` has read it; the oracle
(WrongResult otherwise) checks every gradient against a run with no reclaim, that the
recompute released its input, and that ``h``'s memory is gone after the step.
The ``-verl`` repros install the fix the way it meets verl in a verl process: verl's released
reclaim first (its Megatron engine's init), then ours, which replaces it.

Repros (the reclaims are ``repro.reclaims``'; the unfixed one of the ``-verl`` repros is verl's
released code, ``repro.verl_release``; the MTP checkpoint forms are ``repro.mtp_checkpoints``):

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
On CPU, megatron and verl run through fixes/testing/megatron_cpu.py's RNG and stream shims.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from repro.harness.leaks import ModuleStateLeak, storage_gone
from repro.harness.megatron_world import setup_megatron
from repro.mtp_checkpoints import megatron_mtp_checkpoint
from repro.reclaims import install_reclaim
from repro.registry import Repro, Signature, WrongResult

__all__ = ["REPROS", "SharedViewConfig", "SharedViewModel", "ViewlessAlias",
           "check_grads_equal", "parameter_grads", "shared_view_step"]



@dataclass(kw_only=True, slots=True, frozen=True)
class SharedViewConfig:
    seq_len: int = 16
    hidden: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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


def parameter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, copied."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_grads_equal(got: dict, ref: dict) -> None:
    """WrongResult unless every gradient in ``ref`` is bitwise the one in ``got`` (a reclaim
    changes no value)."""
    for name, g in ref.items():
        if not torch.equal(got[name], g):
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
    reference = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    model.mtp.leak.clear()

    install_reclaim(variant, target, over=over)
    with recompute_reclaim_events() as events:
        weak_h = shared_view_step(model, x, checkpoint, make_viewless)
        if device == "cuda":
            torch.cuda.synchronize()  # surface an asynchronous CUDA fault here
    install_reclaim("none", target)
    check_grads_equal(parameter_grads(model), reference)
    if variant == "ours":
        # The leaked recompute graph holds nothing of the chunk view (its detached copy was
        # released), so the shared storage went when its last reader (the contraction) had run.
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
