"""State a checkpointed layer reads, overwritten by a later layer's forward before the recompute
(Megatron-LM #6793): silently wrong gradients.

Megatron's DSA layers share their top-k indices: a "computing" layer stores them in one holder,
the layers after it read them from there. With activation checkpointing each layer's forward
runs again inside ``backward()`` -- after every later layer's forward, so after the next
computing layer overwrote the holder. A sharing layer's recompute then gathers with another
layer's indices; autograd backpropagates through those, and nothing raises.

The model here, plain torch: four residual layers, each gathering ``k`` of its projected
features by the shared indices; layers 0 and 2 compute the indices (top-k of a score), 1 and 3
reuse them. Gradients are compared with the same model without checkpointing:

- unfixed: each layer under ``torch.utils.checkpoint`` (non-reentrant) or megatron-core's
  ``tensor_parallel.checkpoint`` -> layer 1's recompute reads layer 2's indices ->
  ``WrongResult`` (the loss, computed in the forward, is right);
- under ``fixes.sanitize.recompute_sanitizer()``: ``RecomputeMismatchError`` at layer 1's
  gather, the first op whose recompute values differ from its forward;
- fixed: the holder captured per region, ``fixes.recompute.state_preserving_context_fn`` (torch)
  or ``fixes.recompute.state_preserving`` (megatron-core) -> the reference gradients, exactly.

Run one side by hand: ``python -m repro.child recompute-state-overwrite --unfixed``.
"""

from __future__ import annotations

import torch
from torch import nn

from repro.registry import Repro, Signature, WrongResult

DIM, TOKENS, TOP_K, LAYERS, SEED = 16, 8, 4, 4, 0


class IndexShare:
    """The holder the computing layers write and the sharing layers read (as DSA's)."""

    indices: torch.Tensor | None = None


class SharedIndexLayer(nn.Module):
    def __init__(self, computes: bool, share: IndexShare, generator: torch.Generator):
        super().__init__()
        self.computes, self.share = computes, share
        self.score = nn.Parameter(torch.randn(DIM, DIM, generator=generator) / DIM**0.5)
        self.proj = nn.Parameter(torch.randn(DIM, DIM, generator=generator) / DIM**0.5)
        self.up = nn.Parameter(torch.randn(TOP_K, DIM, generator=generator) / TOP_K**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.computes:
            self.share.indices = torch.topk(x.detach() @ self.score, TOP_K, dim=-1).indices
        picked = torch.gather(torch.tanh(x @ self.proj), -1, self.share.indices)
        return x + picked @ self.up


def _model() -> tuple[nn.ModuleList, IndexShare]:
    g = torch.Generator().manual_seed(SEED)
    share = IndexShare()
    return nn.ModuleList(SharedIndexLayer(i % 2 == 0, share, g) for i in range(LAYERS)), share


def _layer_call(layer, share: IndexShare, checkpointing: str, fixed: bool):
    if checkpointing == "none":
        return layer
    if checkpointing == "torch":
        from torch.utils.checkpoint import checkpoint

        from fixes.recompute import state_preserving_context_fn

        kwargs = {"context_fn": state_preserving_context_fn((share, "indices"))} if fixed else {}
        return lambda x: checkpoint(layer, x, use_reentrant=False, **kwargs)
    from megatron.core import tensor_parallel

    from fixes.recompute import state_preserving

    def call(x):
        # One wrapper per checkpoint call: its first call is this region's forward.
        fn = state_preserving(layer.forward, (share, "indices")) if fixed else layer.forward
        return tensor_parallel.checkpoint(fn, False, x)

    return call


def _step(checkpointing: str, fixed: bool) -> tuple[float, list[torch.Tensor]]:
    layers, share = _model()
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(SEED + 1),
                    requires_grad=True)
    h = x
    for layer in layers:
        h = _layer_call(layer, share, checkpointing, fixed)(h)
    loss = h.pow(2).mean()
    loss.backward()
    # The scores only pick indices (top-k has no gradient): every other parameter has one.
    return float(loss), [p.grad for n, p in layers.named_parameters()
                         if not n.endswith("score")] + [x.grad]


def _run(checkpointing: str, fixed: bool) -> None:
    ref_loss, reference = _step("none", fixed=False)
    loss, got = _step(checkpointing, fixed)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, reference, strict=True))
    print(f"STATE-OVERWRITE loss {loss!r} (reference {ref_loss!r}), max |grad - ref| {diff:.3e}",
          flush=True)
    if diff != 0.0 or loss != ref_loss:
        raise WrongResult(
            f"gradients differ from the no-checkpoint reference: max |grad - ref| = {diff:.3e} "
            f"(loss {loss!r} vs {ref_loss!r}): a sharing layer's recompute read the indices a "
            "later layer's forward stored")


def run(fixed: bool, device: str) -> None:
    if device != "cpu":
        raise ValueError(f"recompute-state-overwrite runs on CPU; got device={device!r}")
    _run("torch", fixed)


def run_megatron(fixed: bool, device: str) -> None:
    if device != "cpu":
        raise ValueError(f"recompute-state-overwrite-megatron runs on CPU; got device={device!r}")
    from fixes.testing.megatron_cpu import install_megatron_cpu_rng_shim

    install_megatron_cpu_rng_shim()
    _run("megatron", fixed)


_SIGNATURES = (Signature(exception="WrongResult", message="gradients differ from the "
                         "no-checkpoint reference"),)
# one step: the detect tier names what differs (the gather's saved index, or the region's
# output), unlocated: no later step runs the region again for the locator
_SANITIZED = (Signature(exception="RecomputeMismatchError", message="differs from its forward ("),)

REPROS = [
    Repro(
        name="recompute-state-overwrite",
        summary="a layer's checkpoint recompute reads state a later layer's forward overwrote "
        "(shared top-k indices): gradients silently wrong",
        run=run, signatures=_SIGNATURES, sanitized_signatures=_SANITIZED,
        sanitizers=("storage", "recompute"), devices=("cpu",), timeout=120.0,
        upstream="Megatron-LM #6793",
    ),
    Repro(
        name="recompute-state-overwrite-megatron",
        summary="the same under megatron-core's tensor_parallel.checkpoint (reentrant)",
        run=run_megatron, signatures=_SIGNATURES, sanitized_signatures=_SANITIZED,
        sanitizers=("storage", "recompute"), devices=("cpu",), requires=("megatron.core",),
        timeout=120.0, upstream="Megatron-LM #6793",
    ),
]
