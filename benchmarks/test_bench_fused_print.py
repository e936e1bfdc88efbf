"""The detect tier's print of one region side on the H200 (``benchmarks.fused_print``: the
tensors a megatron-core MoE layer saves, H=1024 S=2048), fused against per tensor. Asserts what
holds whatever the timing: the fused prints equal the CPU path's, one kernel per side (exact,
and exact plus tolerant), fewer kernels than tensors per tensor; records the times."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import fused_print
from benchmarks._bench import record
from repro import run_isolated

pytestmark = [pytest.mark.gpu, pytest.mark.no_stackfix_sanitize]
_MISSING = [p for p in ("megatron", "triton") if importlib.util.find_spec(p) is None]


DTYPES = ("fp32", "bf16")


def _child() -> dict[str, dict]:
    """Both dtypes in one child: one interpreter, megatron import and Triton compile for both
    (a child per dtype took the refresh ~20 s more)."""
    r = run_isolated(module="benchmarks.fused_print", args=[
        "--device", "cuda", "--size", "1024x2048", "--dtypes", ",".join(DTYPES)], timeout=600,
        forkserver=True)  # torch imported once: the child starts without an interpreter's start
    assert r.returncode == 0, r.stderr[-4000:]
    return fused_print.by_dtype(r.stdout, DTYPES)


@pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {', '.join(_MISSING)}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_side_of_a_megatron_moe_layer(benchmark, figure_book, dtype):
    found: dict = {}

    def run_child():
        found.update(figure_book.get(("fused-print", "cuda"), _child)[dtype])

    benchmark.pedantic(run_child, rounds=1, iterations=1)
    print(json.dumps(found))
    assert not found["kernel_failed"] and found["equal_to_cpu"]
    assert found["fused_kernels"] == found["fused_tolerant_kernels"] == 1
    assert found["per_tensor_kernels"] >= found["printed"]
    record(benchmark, scenario=f"sanitizers/fused-print-moe-layer-1024x2048-{dtype}",
           strategy="fused", device="cuda",
           figures={k: v for k, v in found.items()
                    if k.endswith(("_ms", "_kernels")) or k in ("printed", "elements", "bytes")})

