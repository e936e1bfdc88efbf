"""``fixes.sanitize._fingerprint``: prints that see every value and its position, for every
dtype. Equal bits give equal prints (whatever the tensor's strides); a changed element
anywhere -- also next to a NaN or an inf -- a swap of two elements, a permutation of rows or
of columns changes the print; no dtype crashes (float8 cannot be promoted to float64: the
"Promotion for Float8 Types is not supported" crash)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixes.sanitize import _fingerprint as fp

pytestmark = pytest.mark.cpu


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return fp.first_different([(fp.fingerprint([a]), fp.fingerprint([b]))]) is None


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).clone().view(t.dtype)  # sub-byte dtypes have no copy kernel


def _flip_one_byte(t: torch.Tensor, index: int) -> torch.Tensor:
    out = _copy(t)
    raw = out.view(torch.uint8).reshape(-1)
    raw[index % raw.numel()] ^= 0x01 if t.dtype is torch.bool else 0x10
    return out


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu]
INTS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64]
SUB_BYTE = [getattr(torch, n) for n in ("uint1", "uint2", "uint4", "int1", "int4")
            if hasattr(torch, n)]


def _sample(dtype: torch.dtype, shape=(5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    high = 2 if dtype is torch.bool else 256  # a bool is one byte, 0 or 1
    raw = torch.randint(0, high, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", FLOATS + INTS + SUB_BYTE + [torch.complex64, torch.complex128],
                         ids=str)
def test_every_dtype_is_printed_and_a_changed_byte_is_seen(dtype):
    t = _sample(dtype)
    assert fp.fingerprint([t]) is not None
    assert _same(t, _copy(t))
    for index in (0, 17, t.numel() * t.element_size() - 1):
        assert not _same(t, _flip_one_byte(t, index)), (dtype, index)


def test_float8_tensors_are_printed_in_the_tolerant_mode_too():
    """The tolerant print upcasts float8 before it sums in float64."""
    t = torch.randn(4, 8).to(torch.float8_e4m3fn)
    tolerant = fp.fingerprint([t], tolerant=True)
    assert tolerant is not None and tolerant.approx
    assert fp.first_different([(tolerant, fp.fingerprint([t.clone()], tolerant=True))]) is None


def test_quantized_tensors_are_printed_by_their_integer_representation():
    q = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.qint8)
    other = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.qint8)
    assert _same(q, q.clone()) and not _same(q, other)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 40), cols=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       big=st.booleans())
def test_a_permutation_of_rows_is_seen(rows, cols, seed, big):
    g = torch.Generator().manual_seed(seed)
    if big:  # past the elementwise path: rows and columns weighted separately
        cols = cols + (fp._ELEMENTWISE // rows) + 1
    t = torch.randn(rows, cols, generator=g)
    order = torch.randperm(rows, generator=g)
    if torch.equal(order, torch.arange(rows)):
        order = torch.roll(order, 1)
    assert not _same(t, t[order])
    assert not _same(t, t[:, torch.roll(torch.arange(cols), 1)]) or cols == 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 3 * fp._ROW + 7), seed=st.integers(0, 2**31 - 1))
def test_a_swap_of_two_elements_is_seen_in_1d_tensors_of_any_length(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    i, j = torch.randint(0, n, (2,), generator=g).tolist()
    if i == j:
        j = (i + 1) % n
    swapped = t.clone()
    swapped[i], swapped[j] = t[j], t[i]
    assert not _same(t, swapped)


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_hides_no_other_difference(special):
    """The issue's case: one NaN, 1.0 -> 2.0 elsewhere. (sum, norm) prints were NaN on both
    sides and compared equal."""
    vals = torch.ones(6)
    vals[2] = special
    other = vals * 2.0
    other[2] = special
    assert _same(vals, vals.clone())
    assert not _same(vals, other)
    moved = torch.ones(6)
    moved[3] = special
    assert not _same(vals, moved)  # the same values at another position


@pytest.mark.parametrize("n", [6, fp._ELEMENTWISE + 6, 3 * fp._ROW + 5])
def test_values_that_differ_only_in_high_bits_are_seen_swapped(n):
    """1.0 and -1.0 (the sign bit), 1.0 and -inf (sign and exponent) swapped between two
    positions: products taken modulo 2**32 would sum alike."""
    for a, b in ((1.0, -1.0), (1.0, -float("inf")), (2.0, 0.5)):
        t = torch.full((n,), a)
        t[n // 2] = b
        swapped = torch.full((n,), a)
        swapped[n // 2 + 1] = b
        assert not _same(t, swapped), (a, b, n)
        assert not _same(t.view(2, -1) if n % 2 == 0 else t, swapped.view(2, -1)
                         if n % 2 == 0 else swapped)


def test_a_print_depends_on_the_values_not_the_strides():
    t = torch.randn(64, 48)
    assert _same(t.t(), t.t().contiguous())
    big = torch.randn(300, 400)
    assert _same(big.t(), big.t().contiguous())
    assert _same(big[:, ::2], big[:, ::2].contiguous())


def test_released_storage_is_never_read():
    """A tensor whose storage was resize_(0)-ed (FSDP's reshard, a recompute reclaim): no
    print, no read (on CPU a read is a segmentation fault)."""
    t = torch.randn(16, 16)
    t.untyped_storage().resize_(0)
    assert not fp.readable(t)
    assert fp.fingerprint([t]) is None


def test_first_different_names_the_first_pair():
    a, b = torch.randn(3, 3), torch.randn(5)
    pairs = [(fp.fingerprint([a]), fp.fingerprint([a.clone()])),
             (fp.fingerprint([b]), fp.fingerprint([b + 1])),
             (fp.fingerprint([a]), fp.fingerprint([a * 2]))]
    assert fp.first_different(pairs) == 1
    assert fp.first_different(pairs[:1]) is None
    assert fp.first_different([(fp.fingerprint([a]), None)]) == 0  # one side missing


def test_the_tolerant_print_allows_a_reordered_sum_and_no_more():
    """The tolerant print (ops with atomics on CUDA): a change of a few units in the last place
    of each element passes, a change of one element by 1% does not; positions still count."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 32, generator=g)
    ulps = t + t.abs() * torch.finfo(torch.float32).eps * torch.randint(-2, 3, t.shape,
                                                                        generator=g)
    changed = t.clone()
    changed[5, 7] *= 1.01

    def same(a, b):
        return fp.first_different([(fp.fingerprint([a], tolerant=True),
                                    fp.fingerprint([b], tolerant=True))]) is None

    assert same(t, ulps) and not same(t, changed)
    assert not same(t, t.flip(0))  # rows in another order
    nan = t.clone()
    nan[1, 1] = float("nan")
    assert same(nan, nan.clone()) and not same(nan, t)
