"""A token permutation drawn with ``randperm`` inside a composable ``checkpoint`` whose
recompute does not restore the RNG state (pytorch/pytorch#91265: composable reentrant
activation checkpointing did not restore RNG states, "this allows ops like randperm to behave
the same during re-computation").

The layer shuffles its tokens before the block that mixes them by position; the recompute
draws another permutation, so backward scatters every token's gradient to another token. The
permuted tensor has the same values as the forward's, in another order.

- reference: no checkpoint;
- buggy: ``torch.distributed._composable.checkpoint(layer, preserve_rng_state=False)``, the
  RNG handling before #91265;
- fixed: ``checkpoint(layer)`` (the RNG state restored: the default since #91265).
"""

from __future__ import annotations

import torch
from torch.distributed._composable import checkpoint

from recompute_bugs import Result, Variant

UPSTREAM = "pytorch/pytorch#91265"
TOKENS, DIM = 12, 8


class Shuffle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x):
        order = torch.randperm(x.shape[0])  # <- diverges
        return torch.tanh(x[order] @ self.w)


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    layer = Shuffle()
    position = torch.linspace(0.5, 1.5, TOKENS).unsqueeze(-1)  # the next block mixes by position
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    if variant is Variant.BUGGY:
        checkpoint(layer, preserve_rng_state=False)
    elif variant is Variant.FIXED:
        checkpoint(layer)
    torch.manual_seed(1)
    y = layer(x)
    torch.rand(5)  # the rest of the step draws too
    (y * position).pow(2).sum().backward()
    return {"x.grad": x.grad, "w.grad": layer.w.grad}
