"""BatchNorm's running statistics updated twice by activation checkpointing
(pytorch/pytorch#96136; also pytorch/pytorch#62471, facebookresearch/fairscale#1035).

A checkpointed block with a training-mode BatchNorm runs its forward again in backward, and
that recompute updates ``running_mean``, ``running_var`` and ``num_batches_tracked`` a second
time. Gradients are unchanged; the statistics every later evaluation uses are not those of the
same step without checkpointing.

- reference: no checkpoint;
- buggy: ``checkpoint(..., use_reentrant=False)``;
- fixed: the recompute leaves the statistics as the forward left them, as fairscale's
  ``patch_batchnorm`` keeps a recompute from accumulating them: a recompute context with
  momentum 0 (``running * 1 + batch * 0``: the same bits) that puts ``num_batches_tracked``
  back. (``fixes.recompute.state_preserving_context_fn`` cannot: it restores a tensor only
  when its version counter moved, and batch norm updates the running statistics without
  bumping it.)
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from recompute_bugs import Result, Variant

UPSTREAM = "pytorch/pytorch#96136"


@contextlib.contextmanager
def _statistics_kept(bn: torch.nn.BatchNorm1d):
    momentum, count = bn.momentum, bn.num_batches_tracked.clone()
    bn.momentum = 0.0
    try:
        yield
    finally:
        bn.momentum = momentum
        with torch.no_grad():
            bn.num_batches_tracked.copy_(count)


def step(variant: Variant) -> Result:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    bn = torch.nn.BatchNorm1d(8, momentum=0.3).train()
    x = torch.randn(16, 8, requires_grad=True)

    def block(t):
        return torch.tanh(bn(lin(t)))  # <- diverges

    if variant is Variant.REFERENCE:
        y = block(x)
    elif variant is Variant.BUGGY:
        y = checkpoint(block, x, use_reentrant=False)
    else:
        y = checkpoint(block, x, use_reentrant=False,
                       context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(bn)))
    y.pow(2).sum().backward()
    return {"x.grad": x.grad, "weight.grad": lin.weight.grad, "bn.weight.grad": bn.weight.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var,
            "num_batches_tracked": bn.num_batches_tracked}
