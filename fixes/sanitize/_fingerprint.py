"""What ``recompute_sanitizer()`` compares of one op's outputs, and how exactly.

* ``metadata(outputs)``: ``(shape, dtype, device)`` of every tensor output, on the host.
* ``fingerprint(outputs)``: 0-d float64 tensors on the outputs' device, two per tensor output
  (sum and 2-norm of its values, accumulated in float64), or None. Computed by kernels
  queued on the device: no host synchronisation. The sum sees a sign or a shift, the norm a
  change that sums to zero; a pure permutation of values is not seen.
* tolerance: 0 (bitwise) unless the op class is not deterministic on its device: ops that
  accumulate with atomics on CUDA (``index_add``, ``scatter_add``, accumulating ``index_put``,
  ...) when ``torch.are_deterministic_algorithms_enabled()`` is off. From the first such op of
  a region on, every later fingerprint of that region is compared with a tolerance that allows
  the outputs to differ by ``||dx|| <= ATOMIC_RTOL[dtype] * ||x||`` (a few units in the last
  place per element, from additions taken in another order): ``|d norm| <= rtol * norm`` and
  ``|d sum| <= rtol * sqrt(numel) * norm``.

Allocations of uninitialised memory (``empty`` and friends: ``ALLOCATIONS``) are not compared
at all (whether one runs depends on a cache's state: megatron's GlobalMemoryBuffer), and ops
whose outputs hold uninitialised memory otherwise (``resize_``, ``set_``) get only metadata: their values differ run to run by design. Nor do the outputs an op returns its own RNG
state in (``valued_outputs``): the fused attention kernels return the philox seed and offset
they drew (``_scaled_dot_product_efficient_attention``, ``_flash_attention_forward``, ...),
which a recompute draws anew with no effect on the result when dropout is off (H200: a false
positive on every CUDA SDPA region before this rule). Neither do collectives (``c10d``,
``_c10d_functional``): their outputs are in flight until a wait, so the values read at the op
race with the communication; the next op that reads the result carries them.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree


def _aten(*names: str) -> frozenset:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# Allocations of uninitialised memory: not part of the replayed computation. Whether one runs
# depends on caches, not on the region's inputs: megatron's GlobalMemoryBuffer.get_tensor
# allocates its scratch buffer on the first call and slices it after, so a model's first
# forward allocates and its recompute does not. Neither side records them (``_region``).
ALLOCATIONS = _aten("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                    "empty_permuted")
# Uninitialised outputs: metadata only.
_NO_VALUES = ALLOCATIONS | _aten("resize_", "set_")

# Ops that accumulate with atomicAdd on CUDA (their outputs vary in the last bits run to run,
# as torch.use_deterministic_algorithms documents); exact elsewhere.
ATOMIC_ON_CUDA = _aten("index_add", "index_add_", "scatter_add", "scatter_add_",
                        "scatter_reduce", "scatter_reduce_", "index_put", "index_put_",
                        "_index_put_impl_", "_unsafe_index_put", "index_reduce", "index_reduce_",
                        "bincount", "histc", "put_", "put", "embedding_dense_backward",
                        "_segment_reduce")

# Per dtype: how far (relative, in the 2-norm) outputs may move after atomics reorder their
# additions. tests/test_sanitize_recompute_gpu.py measures the spread of two identical runs of
# an MoE-style index_add combine (two summands per output) next to it: on the H200 0.04 eps
# (fp32) and 0.07 eps (bf16); the headroom covers many more summands per output (the spread
# grows with their square root) and the ops after the atomic one. CPU regions never use it.
ATOMIC_RTOL = {
    torch.float64: 16 * torch.finfo(torch.float64).eps,
    torch.float32: 16 * torch.finfo(torch.float32).eps,
    torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
    torch.float16: 4 * torch.finfo(torch.float16).eps,
}
_DEFAULT_RTOL = 16 * torch.finfo(torch.float32).eps


def tensors(outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):  # the common case, without pytree's walk
        return [outputs]
    return [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]


# Schema names of returns that carry an op's RNG state or scratch, not its result.
_STATE_RETURNS = ("philox", "seed", "rng_state", "debug_attn_mask", "unused")


def valued_returns(func) -> tuple[bool, ...]:
    """Per return of ``func`` (by its schema's names): False for one that holds the op's RNG
    state or scratch, not its result."""
    returns = getattr(getattr(func, "_schema", None), "returns", ())
    return tuple(not any(word in (r.name or "") for word in _STATE_RETURNS) for r in returns)


def valued_outputs(func, outs: list[torch.Tensor],
                   keep: tuple[bool, ...] | None = None) -> list[torch.Tensor]:
    """``outs`` less the returns that hold the op's RNG state (``valued_returns``; only where
    the returns are a flat list of tensors, one per output)."""
    keep = valued_returns(func) if keep is None else keep
    if len(keep) != len(outs) or all(keep):
        return outs
    return [t for t, k in zip(outs, keep, strict=True) if k]


def metadata(outs: list[torch.Tensor]) -> tuple:
    return tuple([(tuple(t.shape), t.dtype, t.device.type) for t in outs])


def _valued(t: torch.Tensor) -> bool:
    return (t.layout is torch.strided and not t.is_meta and t.numel() > 0
            and not t.is_complex())


_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                          "_c10d_functional_autograd"})


def fingerprint(func, outs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Sum and 2-norm of every valued output: 0-d float64 tensors on the outputs' device, two
    per output, queued kernels only (no sync; the comparison stacks them once per region)."""
    if func.overloadpacket in _NO_VALUES or func.namespace in _COLLECTIVES:
        return None
    parts = []
    for t in outs:
        if not _valued(t):
            continue
        x = t.detach()
        if not x.is_floating_point():
            x = x.to(torch.float64)
        parts.append(torch.sum(x, dtype=torch.float64))
        parts.append(torch.linalg.vector_norm(x, dtype=torch.float64))
    if not parts:
        return None
    if len({p.device for p in parts}) > 1:  # outputs on several devices: compare on the host
        parts = [p.cpu() for p in parts]
    return parts


def is_inexact(outs: list[torch.Tensor]) -> bool:
    """For an op in ``ATOMIC_ON_CUDA``: True if its values may differ between two identical
    runs here (on CUDA, unless torch's deterministic algorithms are on)."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    return any(t.device.type == "cuda" for t in outs)


def rtol_scale(outs: list[torch.Tensor]) -> list[float]:
    """Per fingerprint entry (sum, norm of each valued output): the multiplier of the forward's
    norm that an inexact comparison allows."""
    scale = []
    for t in outs:
        if _valued(t):
            rtol = ATOMIC_RTOL.get(t.dtype, _DEFAULT_RTOL)
            scale += [rtol * math.sqrt(t.numel()), rtol]
    return scale
