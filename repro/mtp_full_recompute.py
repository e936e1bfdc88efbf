"""megatron-core 0.18.0 / 0.18.2: a GPT with MTP and full recompute cannot train a step
(verl #7326, Megatron-LM #4933).

``MultiTokenPredictionLayer.forward`` calls ``self._checkpointed_forward(..., padding_mask=...)``
when ``recompute_granularity == "full"`` in training, and that method has no ``padding_mask``
parameter: ``TypeError: MultiTokenPredictionLayer._checkpointed_forward() got an unexpected
keyword argument 'padding_mask'`` at the first forward. 0.16.1 and 0.17.1 pass no padding mask
there; 0.19.0+ take it (``custom_forward`` checkpoints it as a tensor). verl users on 0.18 cannot
train MTP with full recompute at all -- which also hides crash 2's MTP path there.

The model: megatron-core's own GPTModel (local spec, 2 layers, hidden 64, one MTP depth), full
recompute (uniform, 1 layer), world size 1. Unfixed: that TypeError. Fixed
(``fixes.megatron.apply_mtp_recompute_patch``): the step completes, and every gradient equals the
same model's without recompute (WrongResult otherwise). Where the installed megatron-core is not
affected the repro is skipped, saying so.
"""

from __future__ import annotations

import torch

from repro.registry import Repro, Signature, Skipped, WrongResult

__all__ = ["REPROS", "build_gpt_mtp", "gpt_mtp_grads"]


def build_gpt_mtp(device: str, recompute: bool):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1) if recompute else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                            hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                            mtp_num_layers=1, use_cpu_initialization=True, **extra)
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16,
                   mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
    return gpt.to(device).train()


def gpt_mtp_grads(gpt, device: str, padding_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One forward + backward (LM + MTP loss); every parameter's gradient."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=g).to(device)
    pos = torch.arange(16, device=device).expand(2, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device=device).tril().logical_not()
    labels = torch.randint(0, 128, (2, 16), generator=g).to(device)
    kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
    gpt(ids, pos, mask, labels=labels, **kwargs).float().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return {n: p.grad.detach().clone() for n, p in gpt.named_parameters() if p.grad is not None}


def setup(device: str) -> None:
    from fixes.megatron import mtp_recompute_needs_patch
    from repro.harness.megatron_world import setup_megatron

    if not mtp_recompute_needs_patch():
        from megatron.core import __version__

        raise Skipped(f"n/a on megatron-core {__version__}: MultiTokenPredictionLayer's "
                      "forward passes no padding_mask its _checkpointed_forward lacks "
                      "(affected: 0.18.0, 0.18.2)")
    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import (
            install_megatron_cpu_moe_shim,
            install_megatron_cpu_shims,
        )

        install_megatron_cpu_shims(force=True)
        install_megatron_cpu_moe_shim()  # the MTP loss tracker allocates on current_device()


def run(fixed: bool, device: str) -> None:
    from fixes.megatron import apply_mtp_recompute_patch, remove_mtp_recompute_patch

    setup(device)
    reference = gpt_mtp_grads(build_gpt_mtp(device, recompute=False), device)
    if fixed:
        apply_mtp_recompute_patch()
    try:
        got = gpt_mtp_grads(build_gpt_mtp(device, recompute=True), device)
    finally:
        remove_mtp_recompute_patch()
    if got.keys() != reference.keys():
        raise WrongResult(f"parameters with grads differ: {sorted(got.keys() ^ reference.keys())}")
    for name, g in reference.items():
        if not torch.allclose(got[name], g, rtol=1e-5, atol=1e-6):
            raise WrongResult(f"grad of {name} differs from no recompute by "
                              f"{(got[name] - g).abs().max():g}")
    print(f"mtp-full-recompute: {len(got)} grads equal no recompute ({device})", flush=True)


REPROS = [
    Repro(
        name="mtp-full-recompute",
        summary="megatron-core 0.18.x: GPT + MTP with full recompute raises TypeError "
        "(_checkpointed_forward has no padding_mask)",
        run=run,
        signatures=(Signature(exception="TypeError", message="unexpected keyword argument 'padding_mask'"),),
        devices=("cpu", "cuda"),
        requires=("megatron",),
        timeout=180.0,
        upstream="verl #7326; Megatron-LM #4933 (megatron-core 0.18.0 / 0.18.2)",
    ),
]
