"""``nn.RReLU`` under non-reentrant checkpointing: silent wrong gradients
(pytorch/pytorch#193671).

In training mode RReLU allocates its noise with ``empty_like``, autograd packs it as a saved
tensor of ``rrelu_with_noise``, and only then does ``rrelu_with_noise`` fill it. A
non-reentrant checkpoint's recompute stops early, right after the last tensor it needs is
packed (here RReLU's input, packed after the noise) -- before ``rrelu_with_noise`` runs -- so
backward reads the noise buffer unfilled.

- reference: no checkpoint;
- buggy: ``checkpoint(..., use_reentrant=False)`` with early stop on (torch's default);
- fixed: the same with early stop off (``early_stop=False``): the recompute runs the fill.

Uninitialised memory is filled (``torch.utils.deterministic.fill_uninitialized_memory`` under
deterministic algorithms) so that the unfilled buffer never happens to hold the forward's
noise: the buggy step diverges on every run, not only when the allocator hands out fresh
memory.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from recompute_bugs import Result, Variant

UPSTREAM = "pytorch/pytorch#193671"


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    rrelu = torch.nn.RReLU().train()
    x = torch.randn(8, 16, requires_grad=True)

    def block(t):
        return rrelu(lin(t))  # <- diverges

    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        torch.manual_seed(1)
        if variant is Variant.REFERENCE:
            y = block(x)
        else:
            y = checkpoint(block, x, use_reentrant=False, early_stop=variant is Variant.BUGGY)
        (y * y).sum().backward()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    return {"x.grad": x.grad, "weight.grad": lin.weight.grad, "bias.grad": lin.bias.grad}
