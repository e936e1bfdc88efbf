"""The Triton kernel of ``_fused`` (its own module: Triton is imported on first use only, and
reads a kernel's source from its file). Program ``p`` prints elements ``[q * CHUNK, (q + 1) *
CHUNK)`` of tensor ``owner[p]`` (``q``: ``p`` less the tensor's first program), reading them by
address, width and strides from the table, and adds its sums into the tensor's results with
atomics (integer sums wrap alike in any order). The hash runs in uint64: a logical shift is
one instruction, and the bits are those of ``_fused``'s int64 arithmetic."""

import triton
import triton.language as tl

from fixes.sanitize import _fused

# Globals a kernel reads must be constexpr; the multipliers as uint64 literals.
G = tl.constexpr(_fused.G & 0xFFFFFFFFFFFFFFFF)
S = tl.constexpr(_fused.S)
M1 = tl.constexpr(_fused.M1 & 0xFFFFFFFFFFFFFFFF)
M2 = tl.constexpr(_fused.M2 & 0xFFFFFFFFFFFFFFFF)
NCOL = tl.constexpr(_fused.NCOL)
NOUT = tl.constexpr(_fused.NOUT)

# Only builtins and this module's functions: ``_fused`` runs a second copy of this module in
# Triton's interpreter, whose own library functions (``tl.zeros``, ``tl.sum``) were compiled
# for the GPU when Triton was imported.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _mix(z):
    z = (z ^ (z >> 33)) * M1
    z = (z ^ (z >> 33)) * M2
    return z ^ (z >> 33)


@triton.jit
def _offsets(k, contiguous, s1, s2, s3, t0, t1, t2, t3):
    """Element offsets of row-major positions ``k`` (4 dimensions at most, merged)."""
    if contiguous != 0:
        off = k
    else:
        i3 = k % s3
        r = k // s3
        i2 = r % s2
        r = r // s2
        i1 = r % s1
        off = (r // s1) * t0 + i1 * t1 + i2 * t2 + i3 * t3
    return off


@triton.jit(do_not_specialize=["programs_at", "out_at"])
def print_kernel(buf, programs_at, out_at, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(buf + programs_at + pid)
    row = buf + t * NCOL
    addr = tl.load(row)
    n = tl.load(row + 1)
    width = tl.load(row + 2)
    first = tl.load(row + 3)
    kind = tl.load(row + 4)
    mask_bits = tl.load(row + 5)
    contiguous = tl.load(row + 6)
    s1 = tl.load(row + 8)
    s2 = tl.load(row + 9)
    s3 = tl.load(row + 10)
    t0 = tl.load(row + 11)
    t1 = tl.load(row + 12)
    t2 = tl.load(row + 13)
    t3 = tl.load(row + 14)
    start = (pid - first).to(tl.int64) * CHUNK
    end = tl.minimum(n - start, CHUNK)
    k = start + tl.arange(0, BLOCK).to(tl.int64)
    # c_k = k * G + S, stepped by BLOCK * G (wrapping)
    c = k.to(tl.uint64, bitcast=True) * G + S
    step = tl.full([BLOCK], BLOCK, tl.uint64) * G
    acc = tl.full([BLOCK], 0, tl.uint64)
    acc_odd = tl.full([BLOCK], 0, tl.uint64)
    acc_sum = tl.full([BLOCK], 0.0, tl.float64)
    acc_sq = tl.full([BLOCK], 0.0, tl.float64)
    acc_w = tl.full([BLOCK], 0.0, tl.float64)
    for _ in range(0, end, BLOCK):
        inside = k < n
        off = _offsets(k, contiguous, s1, s2, s3, t0, t1, t2, t3)
        b = tl.full([BLOCK], 0, tl.int64)
        x = tl.full([BLOCK], 0.0, tl.float64)
        if width == 1:
            raw8 = tl.load(addr.to(tl.pointer_type(tl.int8)) + off, mask=inside, other=0)
            b = raw8.to(tl.int64)
            if kind == 5:
                x = raw8.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float64)
            elif kind == 6:
                x = raw8.to(tl.float8e5, bitcast=True).to(tl.float32).to(tl.float64)
        elif width == 2:
            raw16 = tl.load(addr.to(tl.pointer_type(tl.int16)) + off, mask=inside, other=0)
            b = raw16.to(tl.int64)
            if kind == 1:
                x = raw16.to(tl.float16, bitcast=True).to(tl.float64)
            elif kind == 2:
                x = raw16.to(tl.bfloat16, bitcast=True).to(tl.float32).to(tl.float64)
        elif width == 4:
            raw32 = tl.load(addr.to(tl.pointer_type(tl.int32)) + off, mask=inside, other=0)
            b = raw32.to(tl.int64)
            if kind == 3:
                x = raw32.to(tl.float32, bitcast=True).to(tl.float64)
        else:
            b = tl.load(addr.to(tl.pointer_type(tl.int64)) + off, mask=inside, other=0)
            if kind == 4:
                x = b.to(tl.float64, bitcast=True)
        y = _mix(b.to(tl.uint64, bitcast=True) ^ c)
        acc += tl.where(inside, y, 0)
        if kind != 0:
            odd = (b & mask_bits) == mask_bits
            acc_odd += tl.where(inside & odd, y, 0)
            xf = tl.where(inside & (odd == 0), x, 0.0)
            g = 1.0 + (c >> 44).to(tl.float64) * (1.0 / 1048576.0)
            acc_sum += xf
            acc_sq += xf * xf
            acc_w += g * xf
        k += BLOCK
        c += step
    out = buf + out_at + t * NOUT
    tl.atomic_add(out, tl.reduce(acc, 0, _add).to(tl.int64, bitcast=True), sem="relaxed")
    if kind != 0:
        outf = out.to(tl.pointer_type(tl.float64), bitcast=True)
        tl.atomic_add(out + 1, tl.reduce(acc_odd, 0, _add).to(tl.int64, bitcast=True),
                      sem="relaxed")
        tl.atomic_add(outf + 2, tl.reduce(acc_sum, 0, _add), sem="relaxed")
        tl.atomic_add(outf + 3, tl.reduce(acc_sq, 0, _add), sem="relaxed")
        tl.atomic_add(outf + 4, tl.reduce(acc_w, 0, _add), sem="relaxed")
