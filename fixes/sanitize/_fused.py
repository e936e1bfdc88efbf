"""The detect tier's prints of one region side: every tensor in one pass, one kernel per device.

``prints(tensors, tolerant)`` gives, per tensor, an exact ``Print`` and (``tolerant``) a
tolerant one, with the meaning ``_fingerprint`` states, by another reduction:

* Exact: with ``b_k`` the ``k``-th element's bits in row-major order (an integer of the
  element's width, sign-extended; complex through its real view, so ``k`` counts real parts
  and imaginary parts; bool, float8, sub-byte dtypes as bytes; quantized through
  ``int_repr``), ``c_k = k * G + S`` (``G`` the 64-bit golden ratio, wrapping) and ``mix``
  MurmurHash3's 64-bit finaliser (a bijection): ``sum_k mix(b_k ^ c_k)``, wrapping int64.
  One changed element always changes the print (``mix`` is a bijection); several changes,
  a swap or any permutation of elements, rows or columns collide only by chance (``mix`` is
  not linear); a NaN or an inf is a bit pattern like any other. Integer sums are exact, so
  neither the kernel's order nor its blocks can change a print.
* Tolerant (floating dtypes; the others get their exact print): over the finite elements ``x_k``
  (float64) the sum, the sum of squares (``Print.roots``: compared as the 2-norm) and
  ``sum_k g_k x_k`` with ``g_k = 1 + (top 20 bits of c_k) / 2**20`` in [1, 2), compared within
  ``ATOMIC_RTOL`` as ``_fingerprint`` says; and ``sum_k mix(b_k ^ c_k)`` over the non-finite
  elements (where a NaN or an inf is and which). float8 with ``fnuz`` or ``e8m0`` encodings
  get their exact print as the tolerant one (stricter; they come out of no atomic op here).

On CUDA one Triton kernel reads every tensor of the device once (a table of data pointers,
sizes and strides, uploaded with the zeroed results in one copy; one program per block of a
tensor; integer and float64 atomics into the results): no host synchronisation, no kernel per
tensor. Elsewhere (CPU; CUDA without Triton) the same sums with batched torch ops, a few per
dtype rather than per tensor. ``kernel_prints`` runs the Triton kernel on any device (on CPU
through Triton's interpreter: the tests check the two paths give the same prints).

``side_prints`` keeps a side's results as the kernel left them (a ``Side``: one int64 tensor of
``NOUT`` columns per device, the float sums as their bits), with no object per tensor: two
sides are compared whole, one column op per device and backward (``columns``), and a tensor's
``Print`` is made only for a side found different. Per tensor the host builds one table row
(its layout cached by shape, strides and dtype): on the GPU hosts a side's Python, not its
kernel, was much of ``values="all"``'s cost on megatron's bf16 cells, and a ``Print`` per
tensor most of a side's (``python -m benchmarks.fused_print --host-stages``).
"""

from __future__ import annotations

import bisect
import contextlib
import math

import torch

from fixes.sanitize._fingerprint import _DEFAULT_RTOL, ATOMIC_RTOL, Print, readable

__all__ = ["kernel_prints", "prints"]

G = -7046029254386353131  # 0x9E3779B97F4A7C15, as int64
S = 0x5851F42D4C957F2D
M1 = -49064778989728563  # 0xFF51AFD7ED558CCD
M2 = -4265267296055464877  # 0xC4CEB9FE1A85EC53
LOW31 = (1 << 31) - 1  # after an arithmetic shift by 33: a logical one

# Floating kinds summed by the tolerant print, and their non-finite test on the bits
# ``(b & mask) == value``: IEEE formats (an all-ones exponent), float8_e4m3fn (NaN only: its
# all-ones exponent holds finite values).
_KIND = {torch.float16: (1, 0x7C00), torch.bfloat16: (2, 0x7F80),
         torch.float32: (3, 0x7F800000), torch.float64: (4, 0x7FF0000000000000),
         torch.float8_e4m3fn: (5, 0x7F), torch.float8_e5m2: (6, 0x7C)}
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NCOL = 16  # table columns per tensor (below)
NOUT = 5  # results per tensor: exact, non-finite, sum, sum of squares, weighted sum
CHUNK = 1 << 15  # elements per program
BLOCK = 1024
NUM_WARPS = 4  # per program (Triton's default)
CPU_BATCH = 1 << 16  # elements per batch of the torch path (measured: fits the caches)


def _real(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the elements whose bits are printed (views only, but for quantized, negative or
    conjugate views)."""
    if t.is_quantized:
        t = t.int_repr()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    elif t.is_neg():
        t = t.resolve_neg()
    return t


# -- results ----------------------------------------------------------------------------------


def _exact(h: torch.Tensor) -> Print:
    return Print(exact=[h])


def _tolerant(ints: torch.Tensor, floats: torch.Tensor, dtype: torch.dtype,
              numel: int) -> Print:
    """From one tensor's results: ``ints`` = (exact, non-finite), ``floats`` = (sum, sum of
    squares, weighted sum); ``dtype`` and ``numel``: the tensor's."""
    rtol = ATOMIC_RTOL.get(dtype, _DEFAULT_RTOL)
    root = math.sqrt(numel)
    odd, total, squares, weighted = ints[1], *floats.unbind()
    return Print(exact=[odd], approx=[total, squares, weighted],
                 scales=[rtol * root, rtol, 2 * rtol * root], norms=[1, 1, 1], roots=[1])


class Side:
    """One side's prints as the kernel left them: per device (``groups``: device -> (the
    indices of its printed tensors, ascending; their results, one row each: ``NOUT`` int64
    columns, the sums' float64 as bits)). ``Print``s are made on demand (``exact``,
    ``loose``): a side compared equal never makes one."""

    __slots__ = ("n", "tolerant", "groups", "summed")

    def __init__(self, n: int, tolerant: bool):
        self.n, self.tolerant = n, tolerant
        self.groups: dict = {}
        # index -> (dtype, numel) of a tensor whose tolerant print is the sums'
        self.summed: dict[int, tuple] = {}

    def add(self, device: torch.device, indices: list[int], res: torch.Tensor,
            tensors: list, summed: list[bool]) -> None:
        """The results ``res`` of the tensors at ``indices`` (``tensors`` theirs, in order),
        on ``device``; ``summed``: which got the tolerant sums."""
        self.groups[device] = (indices, res)
        for i, t, s in zip(indices, tensors, summed, strict=True):
            if s:
                self.summed[i] = (t.dtype, t.numel())

    def _row(self, i: int):
        for indices, res in self.groups.values():
            j = _position(indices, i)
            if j is not None:
                return res[j]
        return None

    def exact(self, i: int) -> Print | None:
        row = self._row(i)
        return None if row is None else _exact(row[0])

    def loose(self, i: int) -> Print | None:
        """Its tolerant print (its exact one where it is no float); None unless tolerant."""
        if not self.tolerant:
            return None
        row = self._row(i)
        if row is None:
            return None
        if i not in self.summed:
            return _exact(row[0])
        dtype, numel = self.summed[i]
        return _tolerant(row[:2], row[2:].view(torch.float64), dtype, numel)

    def prints(self):
        """``prints``'s answer: ``(exact, loose)`` lists, one entry per tensor."""
        exact = [self.exact(i) for i in range(self.n)]
        return exact, ([self.loose(i) for i in range(self.n)] if self.tolerant else None)


def _position(indices: list[int], i: int) -> int | None:
    j = bisect.bisect_left(indices, i)
    return j if j < len(indices) and indices[j] == i else None


def side_prints(tensors: list, tolerant: bool = False) -> Side:
    """The prints of every entry of ``tensors`` (a tensor or None; None and an unreadable
    tensor get none), exact and with ``tolerant`` tolerant too, as a ``Side``: queued kernels
    only, one per device."""
    side = Side(len(tensors), tolerant)
    by_device: dict = {}
    with torch._C._DisableTorchDispatch():
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            for i, t in enumerate(tensors):
                if t is not None and readable(t):
                    by_device.setdefault(t.device, []).append(i)
            for device, indices in by_device.items():
                real = [_real(tensors[i]) for i in indices]
                summed = [tolerant and r.dtype in _KIND for r in real]
                res = None
                if device.type == "cuda" and _triton() is not None:
                    try:
                        res = _launch(real, summed, device)
                    except Exception as exc:  # Triton cannot build it here: the torch path
                        _KERNEL[0] = None
                        FAILED.append(f"{type(exc).__name__}: {exc}")
                if res is None:
                    res = _torch_results(real, summed)
                side.add(device, indices, res, [tensors[i] for i in indices], summed)
        finally:
            torch._C._set_grad_enabled(grad)
    return side


def prints(tensors: list, tolerant: bool = False):
    """Per entry of ``tensors`` (a tensor or None): its exact print (None for None or an
    unreadable tensor), and with ``tolerant`` its tolerant print too (else None):
    ``(exact, loose)``."""
    return side_prints(tensors, tolerant).prints()


def columns(forward: Side, recompute: Side) -> list[tuple]:
    """``(device, forward's, recompute's)``: per device, the exact prints of the tensors
    printed on both sides (of the first ``recompute.n``), as two int64 columns to compare
    whole -- equal columns, equal sides (an element's bits differ, its exact print differs,
    up to a hash collision: the tolerant sums differ only where the bits do). Views where both
    sides printed the same tensors (the rule); an index gather where one could not read one."""
    out = []
    with torch._C._DisableTorchDispatch():
        for device, (f_indices, f_res) in forward.groups.items():
            got = recompute.groups.get(device)
            if got is None:
                continue
            r_indices, r_res = got
            if f_indices == r_indices:
                out.append((device, f_res[:, 0], r_res[:, 0]))
                continue
            both = sorted(set(f_indices).intersection(r_indices))
            if not both:
                continue
            at_f = torch.tensor([_position(f_indices, i) for i in both], device=device)
            at_r = torch.tensor([_position(r_indices, i) for i in both], device=device)
            out.append((device, f_res[at_f, 0], r_res[at_r, 0]))
    return out


# -- the torch path -----------------------------------------------------------------------------


def _torch_results(real: list[torch.Tensor], summed: list[bool]) -> torch.Tensor:
    """The results of ``real`` (``Side``'s rows) with batched torch ops: per dtype, batches of
    up to ``CPU_BATCH`` elements (a large tensor in slices), each a few elementwise ops and an
    ``index_add_`` per result."""
    device = real[0].device
    res = torch.zeros(len(real), NOUT, dtype=torch.int64, device=device)
    out, sums = res[:, :2], res[:, 2:].view(torch.float64)
    by_dtype: dict = {}
    for j, r in enumerate(real):
        by_dtype.setdefault((r.dtype, summed[j]), []).append(j)
    for (dtype, summing), members in by_dtype.items():
        width = dtype.itemsize
        pieces: list = []  # (tensor, flat slice, first position)
        for j in members:
            flat = real[j].reshape(-1)
            for lo in range(0, flat.numel(), CPU_BATCH):
                pieces.append((j, flat[lo:lo + CPU_BATCH], lo))
        batch: list = []
        size = 0
        for piece in pieces:
            if batch and size + piece[1].numel() > CPU_BATCH:
                _torch_batch(batch, width, dtype if summing else None, out, sums)
                batch, size = [], 0
            batch.append(piece)
            size += piece[1].numel()
        _torch_batch(batch, width, dtype if summing else None, out, sums)
    return res


def _torch_batch(batch: list, width: int, summing, out: torch.Tensor,
                 sums: torch.Tensor) -> None:
    """One batch of pieces ``(tensor, flat slice, first position)`` of one dtype: in place
    where it can be (a fresh allocation per op costs a CPU more than the op)."""
    device = out.device
    counts = [p[1].numel() for p in batch]
    n = sum(counts)
    b = torch.empty(n, dtype=torch.int64, device=device)
    torch.cat([p[1].view(_INT[width]) for p in batch], out=b)
    c = (_positions(batch[0][2], n, device) if len(batch) == 1 else
         torch.cat([_positions(p[2], m, device) for p, m in zip(batch, counts, strict=True)]))
    y = torch.bitwise_xor(b, c)
    _mix_(y, torch.empty_like(y))
    owners = torch.tensor([p[0] for p in batch], device=device)
    ends = torch.tensor(counts, device=device).cumsum_(0) - 1
    _add_by_piece(out[:, 0], owners, ends, y)
    if summing is None:
        return
    mask = _KIND[summing][1]
    odd = (b & mask) == mask
    _add_by_piece(out[:, 1], owners, ends, y.masked_fill_(~odd, 0))
    x = torch.empty(n, dtype=torch.float64, device=device)
    torch.cat([p[1] for p in batch], out=x)
    x.masked_fill_(odd, 0.0)
    owner = torch.repeat_interleave(owners, torch.tensor(counts, device=device))
    g = ((c >> 44) & 0xFFFFF).to(torch.float64).mul_(1.0 / (1 << 20)).add_(1.0)
    sums[:, 0].index_add_(0, owner, x)
    sums[:, 2].index_add_(0, owner, g.mul_(x))
    sums[:, 1].index_add_(0, owner, x.square_())


def _add_by_piece(into: torch.Tensor, owners: torch.Tensor, ends: torch.Tensor,
                  y: torch.Tensor) -> None:
    """``into[owner] += sum of y over the piece``, wrapping: by prefix sums (exact in modular
    arithmetic), one ``index_add_`` for the batch."""
    if owners.numel() == 1:
        into[owners[0]] += y.sum()
        return
    at = y.cumsum(0)[ends]
    at[1:] -= at[:-1].clone()
    into.index_add_(0, owners, at)


def _mix_(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``_mix`` in place (``t``: scratch of ``z``'s size)."""
    for m in (M1, M2):
        torch.bitwise_right_shift(z, 33, out=t)
        z ^= t.bitwise_and_(LOW31)
        z *= m
    torch.bitwise_right_shift(z, 33, out=t)
    z ^= t.bitwise_and_(LOW31)
    return z


_POSITIONS: dict = {}  # device -> c_k for the first positions (grown by powers of two)
POSITIONS_CACHED = 1 << 20


def _positions(lo: int, n: int, device: torch.device) -> torch.Tensor:
    """``c_k = k * G + S`` for ``k`` in ``[lo, lo + n)`` (a view of a cache when it fits)."""
    hi = lo + n
    if hi > POSITIONS_CACHED:
        return torch.arange(lo, hi, device=device).mul_(G).add_(S)
    have = _POSITIONS.get(device)
    if have is None or have.numel() < hi:
        size = min(POSITIONS_CACHED, 1 << max(12, (hi - 1).bit_length()))
        have = _POSITIONS[device] = torch.arange(size, device=device).mul_(G).add_(S)
    return have[lo:hi]


# -- the Triton path ----------------------------------------------------------------------------

_KERNEL: list = []  # [the jitted kernel or None, the interpreted one], filled on first use
FAILED: list[str] = []  # why the kernel was given up for the torch path (the GPU tests read it)


def _triton():
    if not _KERNEL:
        try:
            from fixes.sanitize import _fused_kernel
            _KERNEL.append(_fused_kernel.print_kernel)
        except Exception as exc:  # no Triton here: the torch path
            _KERNEL.append(None)
            FAILED.append(f"{type(exc).__name__}: {exc}")
    return _KERNEL[0]


def _dims(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``t``'s sizes and strides with adjacent dimensions merged where they can be (and size-1
    ones dropped), front-padded to 4; None where more than 4 remain."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if size == 1:
            continue
        if sizes and stride == strides[0] * sizes[0]:
            sizes[0] *= size
            continue
        sizes.insert(0, size)
        strides.insert(0, stride)
    if len(sizes) > 4:
        return None
    pad = 4 - len(sizes)
    return [1] * pad + sizes, [0] * pad + strides


_LAYOUTS: dict = {}  # (shape, strides, dtype, summed) -> a table row's columns 4 to 15
LAYOUTS_KEPT = 4096
OWNERS_LISTED = 256  # programs up to which their owners are listed in Python (else by torch)


def _layout(r: torch.Tensor, summed: bool) -> list[int] | None:
    """A table row's kind, non-finite mask, contiguous flag, sizes and strides for ``r``
    (cached: a side's layouts recur every step); None where ``r`` has more than 4 dimensions
    that cannot merge."""
    key = (r.shape, r.stride(), r.dtype, summed)
    row = _LAYOUTS.get(key)
    if row is None:
        dims = _dims(r)
        if dims is None:
            return None
        sizes, strides = dims
        kind, mask = _KIND[r.dtype] if summed else (0, 0)
        contiguous = int(sizes[:3] == [1, 1, 1] and strides[3] == 1)
        row = [kind, mask, contiguous, *sizes, *strides, 0]
        if len(_LAYOUTS) >= LAYOUTS_KEPT:
            _LAYOUTS.clear()
        _LAYOUTS[key] = row
    return row


def _table(real: list[torch.Tensor], summed: list[bool], chunk: int):
    """The kernel's input as one int64 host tensor: per tensor ``NCOL`` columns (address,
    numel, element width, first program, kind, non-finite mask, contiguous, 4 sizes, 4
    strides, unused), the owner of each program, the zeroed results. Also: copies made of
    tensors with more than 4 dimensions that cannot merge (held until the launch)."""
    rows: list[int] = []
    programs: list[int] = []
    held: list[torch.Tensor] = []
    first = 0
    for j, r in enumerate(real):
        layout = _layout(r, summed[j])
        if layout is None:
            r = r.contiguous()
            held.append(r)
            layout = _layout(r, summed[j])
        n = r.numel()
        count = -(-n // chunk)
        rows += [r.data_ptr(), n, r.element_size(), first, *layout]
        programs.append(count)
        first += count
    tail = [0] * (NOUT * len(real))
    if first <= OWNERS_LISTED:
        owners = [j for j, count in enumerate(programs) for _ in range(count)]
        host = torch.tensor(rows + owners + tail, dtype=torch.int64)
    else:  # C loops, not a Python list of every program
        host = torch.cat([torch.tensor(rows, dtype=torch.int64),
                          torch.repeat_interleave(torch.arange(len(real)),
                                                  torch.tensor(programs)),
                          torch.tensor(tail, dtype=torch.int64)])
    return host, first, held


def _launch(real: list[torch.Tensor], summed: list[bool], device: torch.device,
            chunk: int = CHUNK, block: int = BLOCK,
            num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The results of ``real`` (``Side``'s rows, on ``device``): one launch."""
    host, programs, held = _table(real, summed, chunk)
    n = len(real)
    if device.type == "cuda":
        buf = host.pin_memory().to(device, non_blocking=True)
    else:
        buf = host.to(device)
    out_at = n * NCOL + programs
    kernel = _triton() if device.type == "cuda" else _interpreted()
    if device.type == "cuda":
        # Triton launches on the current device: switched only where it is another
        with (contextlib.nullcontext() if device.index == torch.cuda.current_device()
              else torch.cuda.device(device)):
            kernel[(programs,)](buf, n * NCOL, out_at, CHUNK=chunk, BLOCK=block,
                                num_warps=num_warps)
    else:
        kernel[(programs,)](buf, n * NCOL, out_at, CHUNK=chunk, BLOCK=block)
    del held
    return buf[out_at:].view(n, NOUT)


def _interpreted():
    """The kernel as Triton's interpreter runs it on CPU tensors: a second copy of its module,
    decorated with ``TRITON_INTERPRET`` set (``triton.jit`` reads it then)."""
    if len(_KERNEL) < 2:
        import importlib.util
        import os

        try:  # imported lazily by a launch; under TRITON_INTERPRET its import fails (3.9)
            import triton.experimental.gluon  # noqa: F401
        except ImportError:
            pass
        spec = importlib.util.find_spec("fixes.sanitize._fused_kernel")
        module = importlib.util.module_from_spec(spec)
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            spec.loader.exec_module(module)
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
        _triton()
        _KERNEL.append(module.print_kernel)
    return _KERNEL[1]


def kernel_prints(tensors: list, tolerant: bool = False, chunk: int = CHUNK,
                  block: int = BLOCK):
    """``prints`` through the Triton kernel on every device (CPU: Triton's interpreter; a
    small ``chunk`` and ``block`` keep it fast)."""
    real = [_real(t) for t in tensors]
    summed = [tolerant and r.dtype in _KIND for r in real]
    side = Side(len(tensors), tolerant)
    device = real[0].device
    side.add(device, list(range(len(real))), _launch(real, summed, device, chunk, block),
             tensors, summed)
    return side.prints()
