"""Ops that give a new TensorImpl on the same storage, shared by the alias-graph property tests
(``test_storage_exclusive``, ``test_recompute_reclaim``). Shapes stay 2-D, sizes >= 1."""

from __future__ import annotations

import torch


def data_alias(t: torch.Tensor) -> torch.Tensor:
    """megatron's make_viewless_tensor: a new tensor whose ``.data`` is t's (no ``_base``)."""
    out = torch.empty((1,), dtype=t.dtype, device=t.device)
    out.data = t.data
    assert out._base is None
    return out


# Views autograd differentiates through (a checkpoint input can be made from any chain of them).
GRAD_VIEW_OPS = {
    "chunk": lambda t: torch.chunk(t, 2, dim=-1)[-1],
    "narrow": lambda t: t.narrow(0, 0, max(1, t.shape[0] - 1)),
    "slice": lambda t: t[:, ::2],
    "transpose": lambda t: t.t(),
    "expand": lambda t: t[:1].expand(3, t.shape[1]),
    "as_strided": lambda t: t.as_strided((1, 1), (1, 1)),
}

# Every way to share a storage, including the ones that leave autograd.
VIEW_OPS = {
    **GRAD_VIEW_OPS,
    "view": lambda t: t.reshape(-1).view(1, -1) if t.is_contiguous() else t[:1],
    "detach": lambda t: t.detach(),
    "data_alias": data_alias,
}
