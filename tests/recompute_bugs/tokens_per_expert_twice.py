"""An MoE tokens-per-expert count updated inside a checkpointed layer, counted again by the
recompute (pytorch/torchtitan#4568; also #4622).

The router adds the tokens it sends to each expert to a buffer (aux-loss-free load balancing
steers the next step's expert bias by it). The add is in the layer's forward, so under
activation checkpointing the recompute in backward adds the same counts a second time.

- reference: no checkpoint;
- buggy: ``checkpoint(..., use_reentrant=False)``;
- fixed: the buffer captured per region (``fixes.recompute.state_preserving_context_fn``): the
  recompute starts from the forward's counts and its own update is undone.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from fixes.recompute import state_preserving_context_fn
from recompute_bugs import Result, Variant

UPSTREAM = "pytorch/torchtitan#4568"
DIM, TOKENS, EXPERTS = 16, 32, 4


class CountingMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(DIM, EXPERTS) / DIM**0.5)
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM)
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))

    def forward(self, x):
        weight, expert = torch.softmax(x @ self.router, dim=-1).max(dim=-1)
        with torch.no_grad():
            self.tokens_per_expert.add_(torch.bincount(expert, minlength=EXPERTS))  # <- diverges
        out = torch.einsum("td,tde->te", x, self.experts[expert])
        return x + weight.unsqueeze(-1) * out


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    layers = [CountingMoE() for _ in range(2)]
    h = x = torch.randn(TOKENS, DIM, requires_grad=True)
    for layer in layers:
        if variant is Variant.REFERENCE:
            h = layer(h)
        elif variant is Variant.BUGGY:
            h = checkpoint(layer, h, use_reentrant=False)
        else:
            h = checkpoint(layer, h, use_reentrant=False, context_fn=state_preserving_context_fn(
                (layer, "tokens_per_expert")))
    h.pow(2).sum().backward()
    out = {"x.grad": x.grad}
    for i, layer in enumerate(layers):
        out[f"{i}.tokens_per_expert"] = layer.tokens_per_expert
        out[f"{i}.router.grad"] = layer.router.grad
    return out
