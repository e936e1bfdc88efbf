"""What ``recompute_sanitizer()`` keeps of a tensor's values, and how two are compared.

A fingerprint (``Print``) is a handful of 0-d tensors on the tensor's device, computed by
queued kernels (no host synchronisation); comparisons stack many at once (``first_different``:
one synchronisation per device). This module prints the locator's op stream, one op at a time;
the detect tier prints a whole region side at once with ``_fused`` (the same guarantees, by a
hash of each element with its position: one kernel per side on CUDA).

* Exact (the default): the tensor's bits, read as integers of its element width (every dtype:
  float8 and the other 1-byte floats, sub-byte and bool as bytes, complex through its real
  view, quantized through ``int_repr``), reduced with odd position weights in wrapping int64
  arithmetic: ``sum_i W[i] * bits[i]`` up to ``_ELEMENTWISE`` elements, beyond that the row
  sums weighted by row and the column sums weighted by column (rows: every dimension but the
  last; a permutation that keeps every row's and every column's bit sum is not seen).
  Equal prints are equal bits up to a hash collision; a NaN or inf is a bit pattern like any
  other (a difference elsewhere in the tensor is still seen), and a permutation of rows,
  of columns or of a small tensor's elements changes the print. Integer sums are exact, so
  the kernels' reduction order cannot change a print.
* Tolerant: for ops that are not deterministic on their device (``ATOMIC_ON_CUDA``, when
  ``torch.are_deterministic_algorithms_enabled()`` is off; a region compares tolerantly from
  its first such op on, see ``_region``): the finite values' sum, 2-norm and row sums
  weighted by row in float64 (float8 is upcast first), compared within ``ATOMIC_RTOL``
  (``|d norm| <= rtol * norm``, ``|d sum| <= rtol * sqrt(numel) * norm``, the weighted sum
  twice that), and the exact print of where the tensor is not finite.

Not fingerprinted (``None``): a tensor without strided storage (sparse, meta, fake), an empty
one, and the outputs ``no_values`` names: allocations of uninitialised memory, ``resize_`` /
``set_``, the returns an op hands its own RNG state in (``valued_returns``: fused attention's
philox seed and offset, which a recompute draws anew with no effect on the result when dropout
is off: H200, a false positive on every CUDA SDPA region before this rule), and collectives'
outputs (in flight until a wait; the next op that reads them carries their values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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

_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                          "_c10d_functional_autograd"})
# Schema names of returns that carry an op's RNG state or scratch, not its result.
_STATE_RETURNS = ("philox", "seed", "rng_state", "debug_attn_mask", "unused")
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# A tensor of at most this many elements is weighted element by element (a temporary of its
# size in int64: 128 KiB at most); a larger one by its row and column sums (no temporary of
# its size). The products must be int64: in int32 two bit patterns that differ only in high
# bits (a sign, an exponent: 1.0 and -inf) swapped between two positions wrap to the same sum.
_ELEMENTWISE = 1 << 14
_ROW = 4096  # a large 1-D tensor's row length


def tensors(outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):  # the common cases, without pytree's walk
        return [outputs]
    if type(outputs) in (tuple, list) and all(x is None or isinstance(x, torch.Tensor)
                                              for x in outputs):
        return [t for t in outputs if t is not None]
    return [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]


def no_values(func) -> bool:
    """True for an op whose outputs are not fingerprinted at all (see the module docstring)."""
    return func.overloadpacket in _NO_VALUES or func.namespace in _COLLECTIVES


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
    """A tensor with values of its own: strided, real storage, not empty, not a subclass
    (fake, functional, DTensor's wrapper)."""
    return (t.layout is torch.strided and not t.is_meta and t.numel() > 0
            and type(t) in (torch.Tensor, torch.nn.Parameter))


def readable(t: torch.Tensor) -> bool:
    """True if ``t``'s values can be read: ``_valued``, and its storage still holds every
    element (a storage released by ``resize_(0)`` -- FSDP's reshard, a recompute reclaim --
    must never be read: on CPU that is a segmentation fault)."""
    if not _valued(t):
        return False
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return extent(t.shape, t.stride(), t.storage_offset()) * t.element_size() <= nbytes


def extent(shape, strides, offset: int) -> int:
    """One past the last element a tensor of this shape, strides and storage offset reads, in
    elements from its storage's start (a tensor with an element)."""
    end = offset + 1
    for size, stride in zip(shape, strides, strict=True):
        end += (size - 1) * abs(stride)
    return end


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width, same shape (a 16-byte complex: its real
    view, last dimension doubled). Views only: no kernel runs. Called with grad disabled."""
    x = t
    if x.is_quantized:
        x = x.int_repr()
    if x.is_complex():
        x = x.resolve_conj()
        if x.element_size() > 8:
            x = torch.view_as_real(x)
    elif x.is_neg():
        x = x.resolve_neg()
    return x.view(_INT_OF_WIDTH[x.element_size()])


# -- position weights --------------------------------------------------------------------------

_weights: dict = {}


def _mix(index: torch.Tensor, salt: int) -> torch.Tensor:
    """splitmix64 of ``index + salt`` in wrapping int64 arithmetic (arithmetic shifts: still a
    fixed bijective-enough mix), made odd."""
    z = index * -7046029254386353131 + salt  # 0x9E3779B97F4A7C15 as int64
    z = (z ^ (z >> 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * -7723592293110705685  # 0x94D049BB133111EB
    return (z ^ (z >> 31)) | 1


def weights(n: int, device: torch.device, salt: int = 0) -> torch.Tensor:
    """The first ``n`` int64 position weights for ``salt`` on ``device`` (grown by powers of
    two; every length's weights are a prefix of the next)."""
    key = (device, salt)
    have = _weights.get(key)
    if have is None or have.numel() < n:
        size = 1 << max(10, (n - 1).bit_length())
        with torch._C._DisableTorchDispatch():
            have = _mix(torch.arange(size, dtype=torch.int64), salt).to(device)
        _weights[key] = have
    return have[:n]


_FLOAT_WEIGHTS: dict = {}


def _float_weights(n: int, device: torch.device) -> torch.Tensor:
    """Row weights in [1, 2) for the tolerant print (float64, from the int64 weights)."""
    key = device
    have = _FLOAT_WEIGHTS.get(key)
    if have is None or have.numel() < n:
        ints = weights(n, device, salt=2)
        have = 1.0 + (ints & 0xFFFFF).to(torch.float64) / float(1 << 20)
        _FLOAT_WEIGHTS[key] = have
    return have[:n]


# -- prints --------------------------------------------------------------------------------


@dataclass(slots=True)
class Print:
    """The fingerprint of some tensors: ``exact`` 0-d int64 tensors, and for a tolerant print
    ``approx`` 0-d float64 tensors with, per entry, the multiple of the tensor's forward norm
    it may move by (``scales``) and where that norm is in ``approx`` (``norms``); ``roots``:
    the entries of ``approx`` that hold a square (compared, and used as a norm, by their root:
    ``_fused`` sums squares where a kernel cannot take the root after its last block)."""

    exact: list[torch.Tensor] = field(default_factory=list)
    approx: list[torch.Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    norms: list[int] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)

    @property
    def device(self) -> torch.device | None:
        first = self.exact[0] if self.exact else (self.approx[0] if self.approx else None)
        return None if first is None else first.device

    def shape(self) -> tuple[int, int]:
        return len(self.exact), len(self.approx)


def _weighted(b: torch.Tensor) -> list[torch.Tensor]:
    """Row sums weighted by row and column sums weighted by column, of a tensor of >= 2
    dimensions (rows: every dimension but the last); no temporary of its size."""
    rows = b.sum(-1, dtype=torch.int64).reshape(-1)
    cols = b.sum(tuple(range(b.dim() - 1)), dtype=torch.int64)
    return [torch.sum(rows * weights(rows.numel(), b.device, salt=0), dtype=torch.int64),
            torch.sum(cols * weights(cols.numel(), b.device, salt=1), dtype=torch.int64)]


def _exact_parts(t: torch.Tensor) -> list[torch.Tensor]:
    b = bits(t)
    n = b.numel()
    if n <= _ELEMENTWISE:
        flat = b.reshape(-1)  # a copy of a small non-contiguous tensor at most
        return [torch.sum(flat * weights(n, flat.device), dtype=torch.int64)]
    if b.dim() >= 2:
        return _weighted(b)
    # A large 1-D tensor: as rows of _ROW elements, and the rest element by element.
    flat = b.contiguous()
    head = (n // _ROW) * _ROW
    parts = _weighted(flat[:head].view(-1, _ROW))
    if head < n:
        tail = flat[head:]
        parts.append(torch.sum(tail * weights(tail.numel(), tail.device, salt=3),
                               dtype=torch.int64))
    return parts


def _as_float(t: torch.Tensor) -> torch.Tensor:
    x = t
    if x.is_quantized:
        x = x.dequantize()
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    if x.dtype.itemsize == 1 and x.is_floating_point() or not x.is_floating_point():
        x = x.to(torch.float32)  # float8 cannot be promoted directly; integers and bool
    return x


def _tolerant_parts(t: torch.Tensor, out: Print) -> None:
    x = _as_float(t)
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0.0)
    norm_at = len(out.approx) + 1
    rtol = ATOMIC_RTOL.get(t.dtype, _DEFAULT_RTOL)
    root = math.sqrt(t.numel())
    rows = xf.sum(-1, dtype=torch.float64).reshape(-1) if xf.dim() else xf.reshape(1).double()
    out.approx += [torch.sum(xf, dtype=torch.float64),
                   torch.linalg.vector_norm(xf, dtype=torch.float64),
                   torch.sum(rows * _float_weights(rows.numel(), rows.device))]
    out.scales += [rtol * root, rtol, 2 * rtol * root]
    out.norms += [norm_at] * 3
    out.exact += _exact_parts(torch.where(finite, torch.zeros((), dtype=x.dtype,
                                                              device=x.device), x))


def fingerprint(outs: list[torch.Tensor], tolerant: bool = False,
                checked: bool = True) -> Print | None:
    """The print of every readable tensor of ``outs`` (None if there is none); queued kernels
    only, run past every dispatch mode. ``checked=False``: ``outs`` were just made by an op
    (their storage cannot have been released): only ``_valued`` is asked."""
    out = Print()
    with torch._C._DisableTorchDispatch():
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            for t in outs:
                if not (readable(t) if checked else _valued(t)):
                    continue
                if tolerant and (t.is_floating_point() or t.is_complex()):
                    _tolerant_parts(t, out)
                else:
                    out.exact += _exact_parts(t)
        finally:
            torch._C._set_grad_enabled(grad)
    if not out.exact and not out.approx:
        return None
    if len(out.exact) + len(out.approx) > 1:
        devices = {p.device for p in (*out.exact, *out.approx)}
        if len(devices) > 1:  # outputs on several devices: compare on the host
            out.exact = [p.cpu() for p in out.exact]
            out.approx = [p.cpu() for p in out.approx]
    return out


def is_inexact(outs: list[torch.Tensor]) -> bool:
    """For an op in ``ATOMIC_ON_CUDA``: True if its values may differ between two identical
    runs here (on CUDA, unless torch's deterministic algorithms are on)."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    return any(t.device.type == "cuda" for t in outs)


def first_different(pairs: list[tuple[Print | None, Print | None]]) -> int | None:
    """The index of the first pair whose prints differ (a missing print on one side only, or
    another shape, counts as different; two missing prints as equal). One host
    synchronisation per device."""
    first: int | None = None
    groups: dict = {}
    for i, (a, b) in enumerate(pairs):
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape() != b.shape() or a.device != b.device:
            first = i if first is None else min(first, i)
            break
        groups.setdefault(a.device, []).append(i)
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        for device, indices in groups.items():
            found = _first_in_group(pairs, indices, device)
            if found is not None:
                first = found if first is None else min(first, found)
    return first


def _first_in_group(pairs, indices: list[int], device) -> int | None:
    owner_exact, owner_approx, fe, re, fa, ra, scale, norm_of = [], [], [], [], [], [], [], []
    roots: list[int] = []
    for i in indices:
        a, b = pairs[i]
        owner_exact += [i] * len(a.exact)
        fe += a.exact
        re += b.exact
        if a.approx:
            base = len(fa)
            owner_approx += [i] * len(a.approx)
            fa += a.approx
            ra += b.approx
            scale += a.scales
            norm_of += [base + k for k in a.norms]
            roots += [base + k for k in a.roots]
    big = torch.iinfo(torch.int64).max
    candidates = []
    if fe:
        bad = torch.stack(fe) != torch.stack(re)
        owners = torch.tensor(owner_exact, dtype=torch.int64, device=device)
        candidates.append(torch.where(bad, owners, big).min())
    if fa:
        f, r = torch.stack(fa), torch.stack(ra)
        if roots:
            at = torch.tensor(roots, dtype=torch.int64, device=device)
            f, r = f.index_copy(0, at, f[at].sqrt()), r.index_copy(0, at, r[at].sqrt())
        norms = f[torch.tensor(norm_of, dtype=torch.int64, device=device)]
        tol = torch.tensor(scale, dtype=torch.float64, device=device) * norms
        bad = ~((f == r) | ((f - r).abs() <= tol))
        owners = torch.tensor(owner_approx, dtype=torch.int64, device=device)
        candidates.append(torch.where(bad, owners, big).min())
    if not candidates:
        return None
    found = int(torch.stack(candidates).min())  # the one host synchronisation of this device
    return None if found == big else found


def describe(p: Print | None) -> str:
    """A short host-side rendering of a print, for an error message (synchronises)."""
    if p is None:
        return "(no values)"
    with torch._C._DisableTorchDispatch():
        exact = [f"{int(v) & 0xFFFFFFFFFFFFFFFF:016x}" for v in p.exact]
        approx = [f"{float(v):.9g}" for v in p.approx]
    return "[" + ", ".join(exact + approx) + "]"
