"""Real megatron-core models trained one step with full recompute, with a reclaim and without:
every parameter's gradient must be bitwise the same (imported by the child interpreters of
tests/test_reclaim_megatron_grads.py and tests/test_recompute_reclaim.py; runs on whichever
megatron ``megatron.core`` resolves to: the installed release, or a Megatron-LM dev checkout put
first on ``sys.path``). The reclaim is one of ``repro.reclaims.VARIANTS``.

Models (local spec, world size 1, 2 layers, hidden 64, sequence 16, batch 2):

- ``gpt-mtp``: a dense GPT with one MTP depth (its input is a chunk view of the decoder output).
- ``moe-aux``: an MoE GPT, 4 experts, top-2, with the load-balancing aux loss on
  (``moe_aux_loss_coeff`` 0.01: megatron skips the aux-loss ops in the no-grad checkpointed
  forward and runs them in the recompute).
- ``mhc-mtp``: Megatron-LM dev's GPT with hyper-connections (2 residual streams) and one MTP
  depth (dev only: ``enable_hyper_connections``).
"""

from __future__ import annotations

import torch

MODELS = ("gpt-mtp", "moe-aux", "mhc-mtp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _build(model: str, dtype: str, device: str):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = dtype == "bf16"
    extra = {
        "gpt-mtp": dict(mtp_num_layers=1),
        "moe-aux": dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                        moe_router_load_balancing_type="aux_loss",
                        moe_token_dispatcher_type="allgather"),
        "mhc-mtp": dict(mtp_num_layers=1, enable_hyper_connections=True, num_residual_streams=2),
    }[model]
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, bf16=bf16,
        params_dtype=DTYPES[dtype], use_cpu_initialization=device == "cpu", **extra)
    if model == "moe-aux":
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    elif model == "mhc-mtp":
        spec = get_gpt_layer_local_spec(enable_hyper_connection=True)
    else:
        spec = get_gpt_layer_local_spec()
    kwargs = {} if model == "moe-aux" else dict(
        mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128,
                   max_sequence_length=16, **kwargs).to(device)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(cfg, gpt)
    gpt.train()  # full recompute runs in training mode only
    return gpt


def grads(gpt, reclaim: str, device: str = "cpu", events: list | None = None
          ) -> dict[str, torch.Tensor]:
    """One forward + backward of ``gpt`` with ``reclaim`` installed; every parameter's
    gradient (``events``: the reclaims' ``ReclaimEvent`` s). The same model and batch for every
    reclaim: on CUDA a second build would draw other weights from megatron's RNG tracker."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from fixes.megatron import recompute_reclaim_events
    from repro.reclaims import install_reclaim

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=g).to(device)
    pos = torch.arange(16, device=device).expand(2, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device=device).tril().logical_not()
    labels = torch.randint(0, 128, (2, 16), generator=g).to(device)
    gpt.zero_grad(set_to_none=True)
    install_reclaim(reclaim, CheckpointFunction)
    try:
        with recompute_reclaim_events() as seen:
            gpt(ids, pos, mask, labels=labels).float().sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()  # an asynchronous CUDA fault surfaces here
        if events is not None:
            events.extend(seen)
    finally:
        install_reclaim("none", CheckpointFunction)
    return {n: p.grad.detach().clone() for n, p in gpt.named_parameters() if p.grad is not None}


def parity(model: str, dtype: str, reclaim: str = "ours", device: str = "cpu") -> str:
    """``bitwise (N grads, M inputs examined)`` (M counts stackfix's events; 0 for another
    reclaim), or which gradients differ."""
    from repro.harness.megatron_world import setup_megatron

    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import (
            install_megatron_cpu_moe_shim,
            install_megatron_cpu_shims,
        )

        install_megatron_cpu_shims(force=True)
        # torch.cuda.current_device() names the CPU: megatron's router and MTP loss tracker
        # allocate there in training mode
        install_megatron_cpu_moe_shim()
    events: list = []
    gpt = _build(model, dtype, device)
    reference = grads(gpt, "none", device)
    got = grads(gpt, reclaim, device, events=events)
    if reference.keys() != got.keys():
        return f"DIFFERENT parameters with grads: {sorted(reference.keys() ^ got.keys())}"
    differ = [n for n in reference if not torch.equal(reference[n], got[n])]
    read = sum(e.role == "input" for e in events)
    return f"DIFFER: {differ}" if differ else f"bitwise ({len(reference)} grads, {read} inputs examined)"
