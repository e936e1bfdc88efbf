"""Crash 2 inside megatron-core: ``CheckpointWithoutOutput`` frees an output that is its input's
storage (Megatron-LM #4497, main 19deef67; the ``resize_(0)``-on-a-shared-storage family of
verl #7328).

The graph is megatron-core's own ``TransformerLayer`` (local spec), with selective recompute
``recompute_modules=["layernorm"]`` and, as its norms, a fused-residual RMSNorm that returns
``(normed, residual)`` with ``residual`` being its input -- what ``TEFusedResidualRMSNorm``
(``fused_residual_rmsnorm=True``, TE's ``MakeExtraOutput`` + ``RMSNorm``) returns; here in
torch, so it runs without Transformer Engine:

1. ``_forward_pre_mlp_layernorm`` runs the norm under ``CheckpointWithoutOutput`` and unpacks
   ``(pre_mlp_layernorm_output, residual)``; ``residual`` shares the hidden states' storage.
2. After the MLP, ``discard_output_and_register_recompute`` calls ``resize_(0)`` on the storage
   of *every* output -- the residual's too, so the hidden states' memory is released.
3. The bias-dropout-add reads ``residual``: a null pointer. (So would the recompute, which reads
   the checkpoint's saved copy of the hidden states.)

Unfixed (megatron-core as released): SIGSEGV on CPU, "an illegal memory access" on CUDA; under
``--sanitize`` the storage sanitizer names the ``resize_(0)`` in
``discard_output_and_register_recompute``. Fixed (``fixes.megatron.apply_output_discard_patch``):
the residual is kept and the normed output freed; the oracle (WrongResult otherwise) checks the
output and every gradient against the same layer without recompute, and that the normed output
was freed while the residual was not.

Upstream (read in the mirrors, 2026-08-22, and the wheels): megatron-core 0.19.2 (and 0.16.1,
whose class has the same discard, though its ``TransformerLayer`` has no ``(output, residual)``
norm path yet) frees every output; Megatron-LM main 19deef67 (#4497, "Checkpoint shared storage
when inputs are returned") keeps an output whose storage ``data_ptr`` is an input's only with
``CheckpointWithoutOutput(retain_input_tensors=True)``, which main passes where the norm declares
``returns_residual`` (``TENorm`` with ``fused_residual_rmsnorm``); any other
``CheckpointWithoutOutput`` user still frees unconditionally. Without Transformer Engine every
``CheckpointWithoutOutput()`` raises ``NameError: FP8GlobalStateManager`` (its
``self.fp8 = fp8 is not None``): ``fixes.testing.megatron_cpu.bind_missing_te_fp8_state`` binds
"FP8 off", on CPU and CUDA.
"""

from __future__ import annotations

import inspect
import signal
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.registry import Repro, Signature, Skipped, WrongResult

__all__ = ["REPROS", "ResidualRMSNorm", "SharedOutputConfig", "build_layer", "layer_forward"]


@dataclass(kw_only=True, slots=True, frozen=True)
class SharedOutputConfig:
    seq_len: int = 16
    batch: int = 2
    hidden: int = 64
    heads: int = 4
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch", "hidden", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ResidualRMSNorm(nn.Module):
    """RMSNorm returning ``(normed, residual)``, ``residual`` the input itself -- the contract of
    megatron's ``TEFusedResidualRMSNorm``; built from a layer spec as megatron's norms are.
    ``returns_residual``: how Megatron-LM main's layer learns that a norm returns the pair (TE's
    norm sets it); the releases look for a tuple instead."""

    returns_residual = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor):
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps), x


def build_layer(device: str, cfg: SharedOutputConfig = SharedOutputConfig(),
                recompute: bool = True, dtype: torch.dtype = torch.float32):
    """megatron-core's ``TransformerLayer`` (local spec, both norms ``ResidualRMSNorm``), with
    selective ``layernorm`` recompute or none. Needs ``repro.harness.megatron_world.setup_megatron``
    first."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fixes.testing.megatron_cpu import bind_missing_te_fp8_state

    bind_missing_te_fp8_state()
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = ModuleSpec(module=ResidualRMSNorm)
    spec.submodules.pre_mlp_layernorm = ModuleSpec(module=ResidualRMSNorm)
    extra = dict(recompute_granularity="selective", recompute_modules=["layernorm"]) if recompute else {}
    config = TransformerConfig(num_layers=1, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
                               normalization="RMSNorm", use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, **extra)
    torch.manual_seed(cfg.seed)
    layer = TransformerLayer(config, spec.submodules).to(device=device, dtype=dtype)
    if recompute and not (layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm):
        raise RuntimeError("megatron did not put the layer's norms under CheckpointWithoutOutput")
    return layer


def layer_forward(layer, x: torch.Tensor):
    """Forward of ``layer`` on a leaf copy of ``x`` (causal mask): (output, the copy)."""
    s = x.shape[0]
    mask = torch.triu(torch.ones(1, 1, s, s, device=x.device), diagonal=1).bool()
    inp = x.detach().clone().requires_grad_(True)
    out, _ = layer(inp, attention_mask=mask)
    return out, inp


def _grads(layer, inp) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    grads["input"] = inp.grad.detach().clone()
    return grads


def why_not_applicable(version: str, config_cls, checkpoint_cls) -> str | None:
    """Why the layer repro does not apply to a megatron-core whose ``TransformerConfig`` and
    ``CheckpointWithoutOutput`` are these, or None where the layer frees the residual."""
    if "fused_residual_rmsnorm" not in config_cls.__dataclass_fields__:
        return (f"n/a on megatron-core {version}: its TransformerLayer has no (output, residual) "
                "norm path (fused_residual_rmsnorm); shared-output-discard-class runs the class "
                "itself")
    if "retain_input_tensors" in inspect.signature(checkpoint_cls.__init__).parameters:
        return (f"n/a on megatron-core {version}: its TransformerLayer keeps a norm's residual "
                "(retain_input_tensors=True where the norm declares returns_residual, Megatron-LM "
                "#4497); shared-output-discard-class shows every other CheckpointWithoutOutput "
                "user still frees it")
    return None


def _require_residual_norm_path() -> None:
    from megatron.core import __version__
    from megatron.core.tensor_parallel import CheckpointWithoutOutput
    from megatron.core.transformer.transformer_config import TransformerConfig

    why = why_not_applicable(__version__, TransformerConfig, CheckpointWithoutOutput)
    if why is not None:
        raise Skipped(why)


def run(fixed: bool, device: str, cfg: SharedOutputConfig = SharedOutputConfig()) -> None:
    from repro.harness.megatron_world import setup_megatron
    from repro.output_discards import output_discard

    _require_residual_norm_path()
    setup_megatron(device)
    reference = build_layer(device, cfg, recompute=False)
    layer = build_layer(device, cfg)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(cfg.seq_len, cfg.batch, cfg.hidden, device=device)
    ref_out, ref_inp = layer_forward(reference, x)
    ref_out.backward(torch.ones_like(ref_out))

    with output_discard("ours" if fixed else "released"):
        out, inp = layer_forward(layer, x)  # unfixed: the residual add reads freed memory
        if device == "cuda":
            torch.cuda.synchronize()  # surface an asynchronous CUDA fault here
        # What the discard left: (normed, residual) of the pre-MLP norm's checkpoint.
        normed, residual = (o.untyped_storage().nbytes()
                            for o in layer.pre_mlp_norm_checkpoint.outputs)
        out.backward(torch.ones_like(out))
        if device == "cuda":
            torch.cuda.synchronize()
    if normed != 0 or residual == 0:
        raise WrongResult(f"the discard left the normed output {normed} bytes and the residual "
                          f"{residual} bytes: it must free the first and keep the second")
    if not torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6):
        raise WrongResult(f"output differs from no recompute by {(out - ref_out).abs().max():g}")
    ref_grads, grads = _grads(reference, ref_inp), _grads(layer, inp)
    for name, g in ref_grads.items():
        if not torch.allclose(grads[name], g, rtol=1e-5, atol=1e-6):
            raise WrongResult(f"grad of {name} differs from no recompute by "
                              f"{(grads[name] - g).abs().max():g}")
    print(f"shared-output-discard: normed output freed, residual kept ({residual} bytes); output "
          f"and {len(grads)} grads equal no recompute", flush=True)


def run_class(fixed: bool, device: str, cfg: SharedOutputConfig = SharedOutputConfig()) -> None:
    """The class alone, on any release that has it (0.16.1 included): a ``(normed, residual)``
    norm under ``CheckpointWithoutOutput``, the residual added after the discard, as
    ``TransformerLayer`` does it."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput

    from fixes.testing.megatron_cpu import bind_missing_te_fp8_state
    from repro.harness.megatron_world import setup_megatron
    from repro.output_discards import output_discard

    setup_megatron(device)
    bind_missing_te_fp8_state()
    torch.manual_seed(cfg.seed)
    norm = ResidualRMSNorm(None, cfg.hidden).to(device)
    proj = nn.Linear(cfg.hidden, cfg.hidden).to(device)
    x = torch.randn(cfg.seq_len, cfg.batch, cfg.hidden, device=device)

    def step(checkpointed: bool):
        inp = x.clone().requires_grad_(True)
        h = inp * 2.0  # a non-leaf hidden state, as a layer's input is
        if checkpointed:
            ckpt = CheckpointWithoutOutput()
            normed, residual = ckpt.checkpoint(norm, h)
        else:
            normed, residual = norm(h)
        y = proj(normed)
        if checkpointed:
            ckpt.discard_output_and_register_recompute(y)
        out = y + residual  # unfixed: the residual's storage is gone
        if device == "cuda":
            torch.cuda.synchronize()
        out.backward(torch.ones_like(out))
        return out.detach(), inp.grad, [p.grad.clone() for p in (*norm.parameters(), *proj.parameters())]

    ref = step(False)
    for p in (*norm.parameters(), *proj.parameters()):
        p.grad = None
    with output_discard("ours" if fixed else "released"):
        got = step(True)
    for name, a, b in (("output", got[0], ref[0]), ("input grad", got[1], ref[1]),
                       *(("parameter grad", a, b) for a, b in zip(got[2], ref[2], strict=True))):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise WrongResult(f"{name} differs from no checkpoint by {(a - b).abs().max():g}")
    print("shared-output-discard-class: output and grads equal no checkpoint", flush=True)


_CRASH = (
    Signature(signal=signal.SIGSEGV, devices=("cpu",)),
    Signature(exception="RuntimeError", message="storage of size 0"),
    Signature(stderr="an illegal memory access", devices=("cuda",)),
)
_SANITIZED = (Signature(exception="ReleasedStorageError", message="discard_output_and_register_recompute"),)

REPROS = [
    Repro(
        name="shared-output-discard",
        summary="megatron-core's CheckpointWithoutOutput resize_(0)s a fused-residual norm's "
        "residual output: its input's storage, read by the residual add",
        run=run,
        signatures=_CRASH,
        sanitized_signatures=_SANITIZED,
        devices=("cpu", "cuda"),
        requires=("megatron",),
        timeout=180.0,
        upstream="Megatron-LM #4497 (main 19deef67, retain_input_tensors); megatron-core <= 0.19.2",
    ),
    Repro(
        name="shared-output-discard-class",
        summary="the same discard on megatron-core's CheckpointWithoutOutput alone (any release "
        "with the class, 0.16.1 included)",
        run=run_class,
        signatures=_CRASH,
        sanitized_signatures=_SANITIZED,
        devices=("cpu", "cuda"),
        requires=("megatron",),
        timeout=180.0,
        upstream="Megatron-LM #4497 (main 19deef67); megatron-core 0.16.1 .. 0.19.2 random.py",
    ),
]
