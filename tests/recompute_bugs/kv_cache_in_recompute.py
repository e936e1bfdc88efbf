"""A KV cache left on while gradient checkpointing: the recompute appends the layer's keys and
values to the cache its forward already filled, and attends over both
(huggingface/transformers#30301, fixed by #30320: ``use_cache`` disabled under gradient
checkpointing, as most HF models do).

With HF's reentrant checkpoint (its default then) nothing checks the recomputed tensors: the
recompute's attention runs over twice the keys and the gradients are silently other ones (the
non-reentrant checkpoint raises a metadata ``CheckpointError`` instead, #30301's shape error).

- reference: no checkpoint, cache on (as a forward-only step keeps it);
- buggy: ``checkpoint(..., use_reentrant=True)`` with the cache on;
- fixed: the cache off while checkpointing (#30320).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from recompute_bugs import Result, Variant

UPSTREAM = "huggingface/transformers#30301"
TOKENS, DIM = 6, 8


class Cache:
    """The append-per-layer part of HF's ``DynamicCache.update``."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, k, v, layer: int):
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=0)
            v = torch.cat([self.values[layer], v], dim=0)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(torch.nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.q, self.k, self.v = (torch.nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x, cache: Cache | None):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)  # <- diverges
        weights = torch.softmax(q @ k.transpose(0, 1) / DIM**0.5, dim=-1)
        return x + weights @ v


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    layers = [Attention(i) for i in range(2)]
    cache = None if variant is Variant.FIXED else Cache()
    h = x = torch.randn(TOKENS, DIM, requires_grad=True)
    for layer in layers:
        if variant is Variant.REFERENCE:
            h = layer(h, cache)
        else:
            h = checkpoint(layer, h, cache, use_reentrant=True)
    h.pow(2).sum().backward()
    out = {"x.grad": x.grad}
    for i, layer in enumerate(layers):
        out.update({f"{i}.{n}.grad": p.grad for n, p in layer.named_parameters()})
    return out
