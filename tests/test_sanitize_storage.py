"""``fixes.sanitize.storage_sanitizer``: a read or write of released storage raises
ReleasedStorageError naming the op, the tensor and the release site, before the kernel runs.

Every case that would touch freed memory if the sanitizer missed it runs in a child process
(``CHILD``: one interpreter, one JSON line per case); what runs in-process never frees memory a
later op reads."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
import torch

from fixes.sanitize import ReleasedStorageError, StorageRelease, storage_sanitizer
from repro import run_isolated

ROOT = str(Path(__file__).parent.parent)
# These tests enter the sanitizers themselves (they refuse to be nested).
pytestmark = pytest.mark.no_stackfix_sanitize

# Each case: (name, code run under the sanitizer with `device` bound; it must raise
# ReleasedStorageError unless its name starts with "ok-"). `release(t)` frees t's storage.
CASES = {
    "chunk-sibling-read": "a, b = torch.chunk(h, 2, -1); release(a); b.sum()",
    "base-read": "a, b = torch.chunk(h, 2, -1); release(a); h + 1",
    "in-place-write": "a, b = torch.chunk(h, 2, -1); release(b); a.add_(1)",
    "copy-into": "a, b = torch.chunk(h, 2, -1); release(a); b.copy_(torch.ones_like(b))",
    "data-alias-read": (
        "out = torch.empty(1, device=device); out.data = h.data; release(h); out.mul(2)"
    ),
    "backward-read": (
        "w = torch.randn(4, 8, device=device, requires_grad=True); y = h.requires_grad_() * w;"
        " release(w); y.sum().backward()"
    ),
    "partial-shrink": "release(h, keep=64); h.sum()",
    # Reads that bypass the dispatcher (a repr turns every mode off; tolist reads in C++).
    "repr": "a, b = torch.chunk(h, 2, -1); release(a); repr(b)",
    "tolist": "a, b = torch.chunk(h, 2, -1); release(a); b.tolist()",
    "ok-partial-shrink-prefix": "release(h, keep=64); h.view(-1)[:16].sum()",
    # Ops that read no element (views are left to torch's own bounds check).
    "ok-metadata-only": (
        "a, b = torch.chunk(h, 2, -1); release(a); b.detach(); torch.empty_like(b);"
        " torch.zeros_like(b); b.shape; b.stride()"
    ),
    "ok-regrown": "release(h); h.untyped_storage().resize_(128); h.zero_().sum()",
    "regrown-too-little": "release(h); h.untyped_storage().resize_(64); h.sum()",
}
# DTensor (a wrapper subclass) is unwrapped first, so its local tensor is checked (CPU mesh).
CPU_CASES = {
    "dtensor-local-read": (
        "from torch.distributed.tensor import DTensor, Replicate;"
        " from repro.harness.spmd_mesh import spmd_mesh;"
        " d = DTensor.from_local(h, spmd_mesh(), [Replicate()]); release(h); (d * 2).to_local()"
    ),
}

CHILD = """
import json, sys, threading, torch
from fixes.sanitize import storage_sanitizer, ReleasedStorageError
device = sys.argv[1]
cases = json.loads(sys.argv[2])

def release(t, keep=0):
    t.untyped_storage().resize_(keep)

for name, code in cases.items():
    h = torch.randn(4, 8, device=device)
    seen = {}
    try:
        with storage_sanitizer() as s:
            exec(code)
            if device == "cuda":
                torch.cuda.synchronize()
        seen["error"] = None
    except ReleasedStorageError as e:
        seen.update(error=type(e).__name__, op=e.op, shape=list(e.shape), message=str(e),
                    site=list(e.release.site), thread=e.release.thread)
    seen["live"] = len(s._live)
    print("CASE " + json.dumps({name: seen}), flush=True)
"""


def _run_cases(device: str, cases: dict) -> dict:
    result = run_isolated(code=CHILD, args=[device, json.dumps(cases)], timeout=240, cwd=ROOT,
                          forkserver=True)
    assert result.ok, f"{result.describe()}\n{result.stderr[-4000:]}"
    out = {}
    for line in result.stdout.splitlines():
        if line.startswith("CASE "):
            out.update(json.loads(line[5:]))
    assert set(out) == set(cases), result.stdout
    return out


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.cpu),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_released_storage_is_named_before_the_kernel_runs(device):
    seen = _run_cases(device, CASES | (CPU_CASES if device == "cpu" else {}))
    for name, case in seen.items():
        if name.startswith("ok-"):
            assert case["error"] is None, (name, case)
            continue
        assert case["error"] == "ReleasedStorageError", (name, case)
        assert case["op"].startswith(("aten.", "Tensor.")), (name, case)
        assert case["site"][0].startswith("<string>:") and case["site"][0].endswith("in release")
        assert "would access freed memory" in case["message"]
        assert device in case["message"] and "released by UntypedStorage.resize_" in case["message"]
    assert seen["chunk-sibling-read"]["op"] == "aten.sum.default"
    assert seen["chunk-sibling-read"]["shape"] == [4, 4]
    assert seen["partial-shrink"]["message"].count("needs 128 bytes of a storage that now holds 64")
    assert seen["copy-into"]["op"] == "aten.copy_.default"
    assert (seen["repr"]["op"], seen["tolist"]["op"]) == ("Tensor.__repr__", "Tensor.tolist")
    assert seen["ok-regrown"]["live"] == 0  # grown again: no longer tracked


@pytest.mark.gpu
def test_backward_on_a_cuda_device_thread_is_checked():
    """Autograd runs a CUDA backward on its device thread; the mode of the thread that called
    backward() is in force there (PyTorch propagates dispatch-mode TLS), so the read of a
    released saved tensor is still caught -- and it happened on that other thread."""
    code = (
        "w = torch.randn(4, 8, device=device, requires_grad=True); x = h.requires_grad_();"
        " y = x * w; threads = []; y.register_hook(lambda g: threads.append("
        "threading.current_thread() is threading.main_thread()));"
        " release(w); y.sum().backward()"
    )
    child = CHILD.replace('    seen["live"] = len(s._live)',
                          '    seen["live"] = len(s._live); seen["main"] = threads')
    result = run_isolated(code=child, args=["cuda", json.dumps({"device-thread": code})],
                          timeout=240, cwd=ROOT)
    assert result.ok, result.stderr[-4000:]
    case = json.loads(result.stdout.split("CASE ", 1)[1])["device-thread"]
    assert case["error"] == "ReleasedStorageError" and case["op"] == "aten.mul.Tensor", case
    assert case["main"] == [False], case  # the hook (and MulBackward) ran off the main thread


# --------------------------------------------------------------------------- in-process


@pytest.mark.cpu
def test_records_each_release_with_its_site_and_thread():
    h = torch.randn(4, 8)
    with storage_sanitizer() as s:
        h.untyped_storage().resize_(0); line = _line()  # noqa: E702
        t = threading.Thread(target=lambda: torch.randn(3).untyped_storage().resize_(4),
                             name="releaser")
        t.start(); t.join()  # noqa: E702
    first, second = s.releases
    assert isinstance(first, StorageRelease)
    assert (first.nbytes_before, first.nbytes_after) == (128, 0)
    assert first.site[0] == f"tests/test_sanitize_storage.py:{line} in " \
        "test_records_each_release_with_its_site_and_thread"
    assert first.thread == "MainThread" and second.thread == "releaser"
    assert (second.nbytes_before, second.nbytes_after) == (12, 4)


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


@pytest.mark.cpu
def test_fast_path_returns_once_released_storages_are_gone():
    with storage_sanitizer() as s:
        h = torch.randn(4, 8)
        a, b = torch.chunk(h, 2, -1)
        a.untyped_storage().resize_(0)
        assert len(s._live) == 1  # the slow path checks every op from here
        del h, a, b
        gc.collect()
        assert s._live == {}  # the storage died with its last tensor: fast path again
        assert len(s.releases) == 1


@pytest.mark.cpu
def test_restores_resize_and_the_mode_stack_also_on_error():
    before_stack = torch._C._len_torch_dispatch_stack()
    tensor_methods = {n: torch.Tensor.__dict__.get(n) for n in ("__repr__", "tolist", "numpy")}
    assert "resize_" not in torch.UntypedStorage.__dict__
    with pytest.raises(ValueError, match="boom"), storage_sanitizer():
        assert "resize_" in torch.UntypedStorage.__dict__
        assert torch._C._len_torch_dispatch_stack() == before_stack + 1
        raise ValueError("boom")
    assert "resize_" not in torch.UntypedStorage.__dict__
    assert {n: torch.Tensor.__dict__.get(n) for n in tensor_methods} == tensor_methods
    assert torch._C._len_torch_dispatch_stack() == before_stack
    with storage_sanitizer():  # and it can be entered again
        pass


@pytest.mark.cpu
def test_nesting_is_refused_with_the_first_entry_named():
    with storage_sanitizer() as outer:
        with pytest.raises(RuntimeError, match=r"already active \(entered at tests/test_sanitize"):
            with storage_sanitizer():
                pass
        torch.randn(2).untyped_storage().resize_(0)  # the outer one still records
    assert len(outer.releases) == 1


@pytest.mark.cpu
def test_is_a_runtime_error_and_no_false_positive_on_fake_or_meta_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert issubclass(ReleasedStorageError, RuntimeError)
    with storage_sanitizer():
        torch.randn(2).untyped_storage().resize_(0)  # slow path on for what follows
        with FakeTensorMode():
            assert torch.randn(4, 8).sum().shape == ()
        assert torch.empty(4, 8, device="meta").t().sum().is_meta
        x = torch.randn(4, requires_grad=True)
        (x * 2).sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 2.0))


@pytest.mark.cpu
def test_torch_compile_still_compiles_under_it():
    """A user dispatch mode makes dynamo skip frames (fullgraph=True then fails); this one
    declares ignore_compile_internals, so compiled regions compile and run unchecked."""
    def f(x):
        return torch.tanh(x @ x.t()).sum()

    x = torch.randn(4, 4)
    with storage_sanitizer():
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert torch.allclose(got, f(x))
    torch._dynamo.reset()
