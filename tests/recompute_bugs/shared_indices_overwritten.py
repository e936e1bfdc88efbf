"""Top-k indices shared through one holder, overwritten before the recompute reads them
(NVIDIA/Megatron-LM#6793).

Megatron's DSA layers share their top-k indices: a computing layer stores them in a holder and
the sharing layers after it read them from there. Under activation checkpointing a layer's
recompute runs in backward, after every later layer's forward -- after the next computing
layer overwrote the holder -- so a sharing layer's recompute gathers with another layer's
indices. Nothing raises.

- reference: no checkpoint;
- buggy: each layer under ``checkpoint(..., use_reentrant=False)``;
- fixed: the holder captured per region (``fixes.recompute.state_preserving_context_fn``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from fixes.recompute import state_preserving_context_fn
from recompute_bugs import Result, Variant

UPSTREAM = "NVIDIA/Megatron-LM#6793"
DIM, TOKENS, TOP_K = 16, 8, 4


class Holder:
    indices: torch.Tensor | None = None


class Layer(torch.nn.Module):
    def __init__(self, computes: bool, share: Holder):
        super().__init__()
        self.computes, self.share = computes, share
        self.score = torch.nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.proj = torch.nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.up = torch.nn.Parameter(torch.randn(TOP_K, DIM) / TOP_K**0.5)

    def forward(self, x):
        if self.computes:
            self.share.indices = (x @ self.score).topk(TOP_K, dim=-1).indices
        picked = torch.gather(x @ self.proj, -1, self.share.indices)  # <- diverges
        return x + torch.tanh(picked @ self.up)


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    share = Holder()
    layers = [Layer(computes=i % 2 == 0, share=share) for i in range(4)]
    h = x = torch.randn(TOKENS, DIM, requires_grad=True)
    for layer in layers:
        if variant is Variant.REFERENCE:
            h = layer(h)
        elif variant is Variant.BUGGY:
            h = checkpoint(layer, h, use_reentrant=False)
        else:
            h = checkpoint(layer, h, use_reentrant=False,
                           context_fn=state_preserving_context_fn((share, "indices")))
    h.pow(2).sum().backward()
    out = {"x.grad": x.grad}
    for i, layer in enumerate(layers):
        out.update({f"{i}.{n}.grad": p.grad for n, p in layer.named_parameters()
                    if p.grad is not None})
    return out
