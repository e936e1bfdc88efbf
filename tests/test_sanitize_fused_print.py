"""``fixes.sanitize._fused``: the detect tier's prints of a region side, every tensor in one pass.

CPU: the batched torch path sees every changed byte of every dtype, any swap (also of a
float64 and its negation, which the position-weighted sum of ``_fingerprint`` cannot see: their
bits differ by 2**63), NaN and inf as bit patterns; its cost grows with dtypes, not tensors; and
the Triton kernel, run by Triton's interpreter on the same tensors, gives the same prints.
GPU: the compiled kernel gives the CPU path's prints, in one launch per side, with no host
synchronisation."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fixes.sanitize import _detect, _fused
from fixes.sanitize import _fingerprint as fp

_NO_TRITON = importlib.util.find_spec("triton") is None
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu]
INTS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64]
SUB_BYTE = [getattr(torch, n) for n in ("uint1", "uint2", "uint4", "int1", "int4")
            if hasattr(torch, n)]
EVERY = FLOATS + INTS + SUB_BYTE + [torch.complex64, torch.complex128]


def _sample(dtype: torch.dtype, shape=(5, 7), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    high = 2 if dtype is torch.bool else 256  # a bool is one byte, 0 or 1
    raw = torch.randint(0, high, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype)


def _key(p: fp.Print | None):
    return None if p is None else [int(v) for v in p.exact]


def _same(a: torch.Tensor, b: torch.Tensor, tolerant: bool = False) -> bool:
    exact, loose = _fused.prints([a, b], tolerant)
    prints = loose if tolerant else exact
    return fp.first_different([(prints[0], prints[1])]) is None


def _flip(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.view(torch.uint8).clone()
    raw = out.reshape(-1)
    raw[index % raw.numel()] ^= 0x01 if t.dtype is torch.bool else 0x10
    return out.view(t.dtype)


def _layouts() -> list[torch.Tensor]:
    """A side's worth of tensors: every dtype, and strided views (transposed, sliced, a 5-d
    view no merge brings down to 4 dimensions, complex through its real view), NaN and inf."""
    g = torch.Generator().manual_seed(1)
    floats = torch.randn(9, 11, generator=g)
    floats[2, 3], floats[4, 5], floats[6, 7] = float("nan"), float("inf"), -float("inf")
    return [*(_sample(d, (3, 13), seed=i) for i, d in enumerate(EVERY)), floats,
            floats.t(), floats[1::2, ::3], floats.to(torch.bfloat16).t(),
            torch.randn(2, 3, 4, 5, 6, generator=g)[:, ::2, :, 1:, ::3],
            torch.randn(6, 5, dtype=torch.complex64, generator=g).t(),
            torch.randn(300, generator=g).to(torch.float8_e5m2)]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_every_dtype_is_printed_and_a_changed_byte_is_seen(dtype):
    t = _sample(dtype)
    exact, loose = _fused.prints([t], tolerant=True)
    assert exact[0] is not None and loose[0] is not None
    assert _same(t, t.view(torch.uint8).clone().view(dtype))
    for index in (0, 17, t.numel() * t.element_size() - 1):
        assert not _same(t, _flip(t, index)), (dtype, index)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.int64, torch.int8])
def test_a_swap_is_seen_even_of_values_that_differ_only_in_the_sign_bit(dtype):
    """``_fingerprint``'s sum of odd weights times bits misses a float64 swapped with its
    negation (the products differ by an even number times 2**63); the hash of each element
    with its position does not."""
    values = torch.tensor([1.0, -1.0, 3.0, 0.5, -2.0, 2.0, 7.0, -3.0, 4.0, 5.0, -4.0, 6.0,
                           -5.0, 9.0, -6.0, 8.0], dtype=torch.float64)
    swapped = values.clone()
    swapped[0], swapped[1] = values[1], values[0]
    assert not _same(values.to(dtype), swapped.to(dtype))
    square = values.view(4, 4)
    assert not _same(square.to(dtype), square.flip(0).to(dtype))  # rows in another order
    assert not _same(square.to(dtype), square.flip(1).to(dtype))  # columns


@pytest.mark.cpu
def test_a_permutation_of_a_large_tensor_is_seen():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(300, 70, generator=g)
    order = torch.randperm(300, generator=g)
    assert not _same(t, t[order])
    assert not _same(t.view(-1), t.view(-1)[torch.randperm(t.numel(), generator=g)])
    assert _same(t.t(), t.t().contiguous())  # the values, not the strides


@pytest.mark.cpu
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_hides_no_other_difference(special):
    vals = torch.ones(6)
    vals[2] = special
    other = vals * 2.0
    other[2] = special
    moved = torch.ones(6)
    moved[3] = special
    for tolerant in (False, True):
        assert _same(vals, vals.clone(), tolerant)
        assert not _same(vals, other, tolerant)
        assert not _same(vals, moved, tolerant)


@pytest.mark.cpu
def test_the_tolerant_print_allows_a_reordered_sum_and_no_more():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 32, generator=g)
    ulps = t + t.abs() * torch.finfo(torch.float32).eps * torch.randint(-2, 3, t.shape,
                                                                        generator=g)
    changed = t.clone()
    changed[5, 7] *= 1.01
    assert not _same(t, ulps) and _same(t, ulps, tolerant=True)
    assert not _same(t, changed, tolerant=True)
    assert not _same(t, t.flip(0), tolerant=True)
    # the norm is summed as a square and compared as a root
    exact, loose = _fused.prints([t], tolerant=True)
    assert loose[0].roots == [1]
    assert float(loose[0].approx[1]) == pytest.approx(float(t.double().square().sum()))


@pytest.mark.cpu
def test_no_print_for_none_an_empty_or_a_released_tensor():
    released = torch.randn(16, 16)
    released.untyped_storage().resize_(0)
    exact, loose = _fused.prints([None, torch.empty(0), released, torch.ones(2)], tolerant=True)
    assert exact[:3] == [None, None, None] and loose[:3] == [None, None, None]
    assert exact[3] is not None and loose[3] is not None
    assert _fused.prints([torch.ones(2)])[1] is None  # no tolerant prints asked for


@pytest.mark.cpu
def test_two_sides_are_compared_whole_only_where_both_read_a_tensor():
    """``columns``: the exact prints of the tensors both sides printed, as two columns (views
    where both printed the same ones); a tensor one side could not read is left out, a
    changed one is a differing row, and a recompute side cut short is compared as far as it
    goes."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(6, 5, generator=g) for _ in range(3))
    released = torch.randn(6, 5)
    released.untyped_storage().resize_(0)
    forward = _fused.side_prints([a, b, c], tolerant=True)
    cols = _fused.columns(forward, _fused.side_prints([a.clone(), b.clone(), c.clone()]))
    assert [d.type for d, _, _ in cols] == ["cpu"] and torch.equal(cols[0][1], cols[0][2])
    changed = c.clone()
    changed[2, 3] += 1
    (_, f, r), = _fused.columns(forward, _fused.side_prints([a, released, changed]))
    assert f.numel() == 2 and (f != r).tolist() == [False, True]
    (_, f, r), = _fused.columns(forward, _fused.side_prints([a]))
    assert f.numel() == 1 and torch.equal(f, r)


@pytest.mark.cpu
def test_a_side_compared_equal_makes_no_print_object(monkeypatch):
    """The detect tier keeps a side as the kernel left it: through a sanitized step whose
    recompute is equal no ``Print`` is made per tensor (``_exact`` / ``_tolerant``); one
    whose recompute differs makes them to name the tensor."""
    from torch.utils.checkpoint import checkpoint

    from fixes.sanitize import RecomputeMismatchError, recompute_sanitizer

    made = []
    for name in ("_exact", "_tolerant"):
        original = getattr(_fused, name)
        monkeypatch.setattr(_fused, name, lambda *a, __f=original: made.append(1) or __f(*a))
    w = torch.randn(8, 8, requires_grad=True)
    calls = []

    def region(x, noisy=False):
        calls.append(1)
        y = (x @ w).relu() @ w
        return y + len(calls) * 1e-3 if noisy else y

    x = torch.randn(4, 8, requires_grad=True)
    with recompute_sanitizer(values="all"):
        checkpoint(region, x, use_reentrant=True).sum().backward()
    assert made == []
    with pytest.raises(RecomputeMismatchError), recompute_sanitizer(values="all"):
        for _ in range(2):  # found in the first step, located in the second
            checkpoint(region, x, True, use_reentrant=True).sum().backward()
    assert made


@pytest.mark.cpu
def test_the_torch_path_batches_by_dtype_not_by_tensor(monkeypatch):
    """The CPU path's cost grows with the dtypes of a side, not its tensors: one
    ``index_add_`` per result and batch of a dtype; batches split anywhere give the same
    prints (a tensor cut between two of them included)."""
    g = torch.Generator().manual_seed(0)
    side = [torch.randn(17, 3, generator=g) for _ in range(40)]
    side += [torch.randn(5, generator=g).to(torch.bfloat16) for _ in range(20)]
    whole = [_key(p) for p in _fused.prints(side)[0]]
    adds = []
    index_add_ = torch.Tensor.index_add_

    def counted(self, *args, **kwargs):
        adds.append(self.dtype)
        return index_add_(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_add_", counted)
    _detect._side(side, printed=True, tolerant=False)
    assert len(adds) == 2  # one per dtype
    adds.clear()
    _detect._side(side, printed=True, tolerant=True)
    assert len(adds) == 2 * 5  # and result
    monkeypatch.setattr(_fused, "CPU_BATCH", 7)
    assert [_key(p) for p in _fused.prints(side)[0]] == whole


def _interpreted_equals_torch_path(side: list[torch.Tensor]) -> None:
    want, want_loose = _fused.prints(side, tolerant=True)
    got, got_loose = _fused.kernel_prints(side, tolerant=True, chunk=64, block=32)
    assert [_key(p) for p in got] == [_key(p) for p in want]
    for a, b in zip(want_loose, got_loose, strict=True):
        assert _key(a) == _key(b) and len(a.approx) == len(b.approx)
        for x, y in zip(a.approx, b.approx, strict=True):
            assert float(x) == pytest.approx(float(y), rel=1e-12, abs=1e-12)
    assert fp.first_different(list(zip(want_loose, got_loose, strict=True))) is None


@pytest.mark.cpu
@pytest.mark.skipif(_NO_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: int64 products wrap (meant)
def test_the_kernel_in_triton_s_interpreter_gives_the_torch_path_s_prints():
    """The definition is one: the Triton kernel (interpreted, on CPU tensors; small programs so
    that a tensor spans several) and the torch path print a side alike, exact parts equal,
    sums equal to float64 rounding. Every element width and float kind, strided and 5-d views,
    complex, NaN and inf (every dtype: the deep test below)."""
    widths = [_sample(d, (3, 13)) for d in (torch.bool, torch.int16, torch.float16,
                                             torch.int32, torch.int64, torch.float8_e4m3fn)]
    _interpreted_equals_torch_path(widths + _layouts()[-7:])


@pytest.mark.cpu
@pytest.mark.deep
@pytest.mark.skipif(_NO_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_kernel_in_triton_s_interpreter_gives_the_torch_path_s_prints_for_every_dtype():
    _interpreted_equals_torch_path(_layouts())


# -- CUDA ---------------------------------------------------------------------------------------


def _to(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` on ``device``; 1-byte dtypes as bytes (not every one has a copy kernel)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).to(device).view(t.dtype)
    return t.to(device)


def _cuda_side() -> list[torch.Tensor]:
    return [_to(t, "cuda") for t in _layouts()]


@pytest.mark.gpu
@pytest.mark.skipif(_NO_TRITON, reason="triton is not installed")
def test_the_cuda_kernel_gives_the_cpu_path_s_prints():
    side = _cuda_side()
    got, got_loose = _fused.prints(side, tolerant=True)
    assert not _fused.FAILED, _fused.FAILED  # the kernel ran, not the torch fallback
    on_cpu = [_to(t, "cpu") for t in side]
    want, want_loose = _fused.prints(on_cpu, tolerant=True)
    assert [_key(p) for p in got] == [_key(p) for p in want]
    for a, b in zip(want_loose, got_loose, strict=True):
        assert _key(a) == _key(b)
        for x, y in zip(a.approx, b.approx, strict=True):
            assert float(x) == pytest.approx(float(y), rel=1e-12, abs=1e-12)
    assert all(p.device.type == "cuda" for p in got)


@pytest.mark.gpu
@pytest.mark.skipif(_NO_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("tolerant", [False, True])
def test_one_kernel_per_side_and_no_host_synchronisation(tolerant):
    """A side of 60 tensors of several dtypes: one kernel (and one host-to-device copy of its
    table), however many tensors; no synchronising call (``set_sync_debug_mode``)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    side = [torch.randn(2048, 1024, device="cuda", generator=g) for _ in range(20)]
    side += [torch.randn(2048, 4096, device="cuda", generator=g).to(torch.bfloat16).t()
             for _ in range(20)]
    side += [torch.randint(0, 8, (2048, 2), device="cuda", generator=g) for _ in range(10)]
    side += [torch.rand(2048, device="cuda", generator=g) > 0.5 for _ in range(10)]
    _detect._side(side, printed=True, tolerant=tolerant)  # compiled before it is counted
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            _detect._side(side, printed=True, tolerant=tolerant)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    assert len(kernels) == 1 and "print_kernel" in kernels[0], kernels
    assert not _fused.FAILED, _fused.FAILED


@pytest.mark.gpu
@pytest.mark.skipif(_NO_TRITON, reason="triton is not installed")
def test_a_changed_element_of_a_large_cuda_tensor_is_seen():
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(4096, 4099, device="cuda", generator=g).to(torch.float8_e4m3fn)
    changed = t.view(torch.uint8).clone()
    changed[4000, 4098] ^= 1
    assert _same(t, t.view(torch.uint8).clone().view(t.dtype))
    assert not _same(t, changed.view(t.dtype))
    assert not _same(t, t.view(torch.uint8).flip(0).view(t.dtype))  # rows in another order


@pytest.mark.cpu
def test_the_benchmarks_side_of_a_layer_is_printed_on_cpu():
    """``benchmarks.fused_print`` end to end at a toy size on CPU: the H200 bench broke on a
    changed sanitizer signature that no CPU test ran."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from repro import run_isolated

    # In a child: megatron's world set up (a process group, model-parallel state, the CPU
    # shims forced onto megatron's classes) would stay in the pytest worker for later tests.
    r = run_isolated(code="import json; from benchmarks import fused_print; "
                          "print(json.dumps(fused_print.measure(128, 32, 'fp32', 'cpu', 1)))",
                     cwd=str(Path(__file__).parent.parent), timeout=120, forkserver=True)
    assert r.ok, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["printed"] > 0 and found["fused_ms"] > 0 and not found["kernel_failed"]


@pytest.mark.cpu
def test_the_h200_benchs_one_child_answers_each_dtype_in_the_order_asked():
    from benchmarks.fused_print import by_dtype as prints_by_dtype

    out = 'noise\nFUSED-PRINT [{"dtype": "float32"}, {"dtype": "bfloat16"}]\n'
    got = prints_by_dtype(out, ("fp32", "bf16"))
    assert got == {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"}}
    with pytest.raises(ValueError, match="FUSED-PRINT"):
        prints_by_dtype("the child died\n", ("fp32",))
    with pytest.raises(ValueError):  # a dtype missing from the child's answer
        prints_by_dtype('FUSED-PRINT [{"dtype": "float32"}]', ("fp32", "bf16"))
