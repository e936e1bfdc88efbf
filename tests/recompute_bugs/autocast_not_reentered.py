"""A recompute that does not re-enter the forward's autocast: megatron-core's
``tensor_parallel.checkpoint`` reruns the region inside ``backward()``, outside the autocast the
forward ran under, so the recompute computes in float32 what the forward computed in bfloat16
(NVIDIA/TransformerEngine#787, fixed by #791 for ``te.checkpoint``; the same for FP8 autocast in
megatron-core's checkpoint: NVIDIA/Megatron-LM#7538).

TransformerEngine's report saw it as a dtype error from a layer outside TE; with only torch
layers in the region the recompute runs through, in float32, and the gradients are taken
through other activations than the loss was.

- reference: no checkpoint, forward under ``torch.autocast("cpu", torch.bfloat16)``;
- buggy: the region under megatron-core's ``tensor_parallel.checkpoint`` (real, 0.16.1);
- fixed: the region function re-enters the autocast state it was first called under, as
  TransformerEngine #791 makes ``te.checkpoint`` do.
"""

from __future__ import annotations

import torch

from recompute_bugs import Result, Variant

UPSTREAM = "NVIDIA/TransformerEngine#787"
REQUIRES = ("megatron.core",)


def _reentering_autocast(fn):
    """``fn`` called under the autocast state of its first call, on every later call."""
    state: dict = {}

    def region(*args):
        if not state:
            state.update(enabled=torch.is_autocast_enabled("cpu"),
                         dtype=torch.get_autocast_dtype("cpu"))
        with torch.autocast("cpu", enabled=state["enabled"], dtype=state["dtype"]):
            return fn(*args)

    return region


def step(variant: Variant) -> Result:
    from megatron.core import tensor_parallel

    from fixes.testing import megatron_on_cpu

    torch.manual_seed(0)
    up, down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def block(t):
        return t + down(torch.relu(up(t))).float()  # <- diverges

    with megatron_on_cpu():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if variant is Variant.REFERENCE:
                y = block(x)
            elif variant is Variant.BUGGY:
                y = tensor_parallel.checkpoint(block, False, x)
            else:
                y = tensor_parallel.checkpoint(_reentering_autocast(block), False, x)
        y.pow(2).sum().backward()
    return {"x.grad": x.grad, "up.grad": up.weight.grad, "down.grad": down.weight.grad}
