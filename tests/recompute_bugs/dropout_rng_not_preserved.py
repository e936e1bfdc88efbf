"""Dropout in a checkpointed block whose recompute does not restore the RNG state
(allenai/OLMo-core#828; also openai/guided-diffusion#167).

OLMo-core applied activation checkpointing with ``preserve_rng_state=False``; once a model with
dropout used it, every recompute drew fresh dropout masks, so the gradients were taken with
respect to another sample than the loss was (turning AC off moved the loss).

- reference: no checkpoint;
- buggy: ``checkpoint(..., use_reentrant=False, preserve_rng_state=False)``;
- fixed: ``preserve_rng_state=True`` (the fix of #828).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from recompute_bugs import Result, Variant

UPSTREAM = "allenai/OLMo-core#828"


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    up, down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def block(t):
        h = torch.nn.functional.dropout(torch.relu(up(t)), p=0.1, training=True)  # <- diverges
        return t + down(h)

    torch.manual_seed(1)
    if variant is Variant.REFERENCE:
        y = block(x)
    else:
        y = checkpoint(block, x, use_reentrant=False,
                       preserve_rng_state=variant is Variant.FIXED)
    torch.manual_seed(2)  # the rest of the step draws too: the recompute starts elsewhere
    torch.rand(3)
    y.pow(2).sum().backward()
    return {"x.grad": x.grad, "up.grad": up.weight.grad, "down.grad": down.weight.grad}
