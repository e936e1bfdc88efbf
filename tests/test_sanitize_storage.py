"""``fixes.sanitize.storage_sanitizer``: a read or write of released storage raises
ReleasedStorageError naming the op, the tensor and the release site, before the kernel runs.

Every case that would touch freed memory if the sanitizer missed it runs in a child process
(``CHILD``: one interpreter, one JSON line per case); what runs in-process never frees memory a
later op reads."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from pathlib import Path

import pytest
import torch

from fixes.sanitize import ReleasedStorageError, StorageRelease, storage_sanitizer
from repro import run_isolated
from repro.harness.optional import require

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
    # A view of a released tensor: torch's own bounds check would raise first, naming nothing.
    "view": "a, b = torch.chunk(h, 2, -1); release(a); b.t()",
    "backward-view": (  # mm's backward first touches the saved chunk through b.t()
        "w = torch.randn(4, 3, device=device, requires_grad=True); a, b = torch.chunk(h, 2, -1);"
        " y = b @ w; release(a); y.sum().backward()"
    ),
    # Another StorageImpl over the same memory (keyed on the data pointer range).
    "dlpack-alias": "u = torch.from_dlpack(torch.to_dlpack(h)); release(h); u.sum()",
    # Other threads: a plain threading.Thread and a pool started while the sanitizer is active.
    "thread-read": "a, b = torch.chunk(h, 2, -1); release(a); in_thread(b.sum)",
    "pool-read": (
        "from concurrent.futures import ThreadPoolExecutor; a, b = torch.chunk(h, 2, -1);"
        " release(a); ThreadPoolExecutor(1).submit(b.sum).result()"
    ),
    # Grown back after the release: the bytes are uninitialised until something writes them.
    "regrown-read": "release(h); h.untyped_storage().resize_(128); h.sum()",
    "regrown-update": "release(h); h.untyped_storage().resize_(128); h.add_(1)",
    # Reads that bypass the dispatcher (tolist reads in C++).
    "tolist": "a, b = torch.chunk(h, 2, -1); release(a); b.tolist()",
    # repr names the release instead of raising (a traceback printer calls it on arguments).
    "ok-repr": "a, b = torch.chunk(h, 2, -1); release(a); result = repr(b)",
    # A new allocation that reuses the released memory, and an alias of it, are not flagged.
    "ok-alias-of-a-new-allocation": (
        "release(h); z = torch.randn(4, 8, device=device);"
        " result = torch.from_dlpack(torch.to_dlpack(z)).sum().item() == z.sum().item()"
    ),
    "ok-partial-shrink-prefix": "release(h, keep=64); h.view(-1)[:16].sum()",
    # Ops that read no element (views are left to torch's own bounds check).
    "ok-metadata-only": (
        "a, b = torch.chunk(h, 2, -1); release(a); b.detach(); torch.empty_like(b);"
        " torch.zeros_like(b); b.shape; b.stride()"
    ),
    "ok-regrown": "release(h); h.untyped_storage().resize_(128); h.zero_().sum()",
    "ok-regrown-copied-into": (
        "release(h); h.untyped_storage().resize_(128); h.copy_(torch.ones(4, 8)); h.sum()"
    ),
    "regrown-too-little": "release(h); h.untyped_storage().resize_(64); h.sum()",
}
# DTensor (a wrapper subclass) is unwrapped first, so its local tensor is checked (CPU mesh).
CPU_CASES = {
    "dtensor-local-read": (
        "from torch.distributed.tensor import DTensor, Replicate;"
        " from repro.harness.spmd_mesh import spmd_mesh;"
        " d = DTensor.from_local(h, spmd_mesh(), [Replicate()]); release(h); (d * 2).to_local()"
    ),
    # An alias that holds no reference to the tensor (a raw pointer through ctypes).
    "frombuffer-alias": (
        "import ctypes; u = torch.frombuffer((ctypes.c_float * 32).from_address(h.data_ptr()),"
        " dtype=torch.float32); release(h); u.sum()"
    ),
}

CHILD = """
import json, sys, threading, torch
from fixes.sanitize import storage_sanitizer, ReleasedStorageError
device = sys.argv[1]
cases = json.loads(sys.argv[2])

def release(t, keep=0):
    t.untyped_storage().resize_(keep)

def in_thread(fn):
    errors = []
    def run():
        try:
            fn()
        except BaseException as e:
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]

for name, code in cases.items():
    h = torch.randn(4, 8, device=device)
    scope = dict(globals(), h=h)
    seen = {}
    try:
        with storage_sanitizer() as s:
            exec(code, scope)
            if device == "cuda":
                torch.cuda.synchronize()
        seen["error"] = None
    except ReleasedStorageError as e:
        seen.update(error=type(e).__name__, op=e.op, shape=list(e.shape), message=str(e),
                    site=list(e.release.site), thread=e.release.thread,
                    caller=list(e.caller))
    except Exception as e:
        seen.update(error=type(e).__name__, message=str(e))
    seen["result"] = str(scope.get("result"))
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
    assert seen["tolist"]["op"] == "Tensor.tolist"
    assert seen["view"]["op"] == "aten.t.default"
    assert seen["backward-view"]["op"] == "aten.t.default"
    assert seen["dlpack-alias"]["op"] == "aten.sum.default"
    for name in ("thread-read", "pool-read"):
        assert seen[name]["op"] == "aten.sum.default", (name, seen[name])
    for name in ("regrown-read", "regrown-update"):
        assert "regrown" in seen[name]["message"] and "uninitialised" in seen[name]["message"]
    assert seen["ok-repr"]["result"].startswith("tensor(<released storage>"), seen["ok-repr"]
    assert seen["ok-alias-of-a-new-allocation"]["result"] == "True"
    assert seen["ok-regrown"]["live"] == 0  # written after it grew again: no longer tracked
    # The message leads with the op's caller (the user's frame) and the release site.
    first = seen["chunk-sibling-read"]
    assert first["caller"][0].startswith("<string>:1 in <module>"), first
    head = first["message"].splitlines()[0]
    assert head.startswith(f"aten.sum.default at {first['caller'][0]}"), head
    assert f"released at {first['site'][0]}" in head, head


# A plain script (no pytest) that prints the error's traceback with its frames' locals once the
# ``with`` block is left: the printer reprs the released chunk after the sanitizer exited.
AFTER_EXIT = """
import gc, traceback, torch
from fixes.sanitize import ReleasedStorageError, storage_sanitizer

TORCH_REPR = torch.Tensor.__repr__

def forward(x):
    return x.sum()

def main():
    a, b = torch.randn(4, 16).chunk(2, -1)
    try:
        with storage_sanitizer():
            a.untyped_storage().resize_(0)
            forward(b)
    except ReleasedStorageError as error:
        report = traceback.TracebackException.from_exception(error, capture_locals=True)
        print("".join(report.format()))
    print("AFTER", repr(b))
    a.untyped_storage().resize_(256)  # grown back outside the sanitizer: readable memory again
    print("REGROWN", repr(b.zero_()))

main()
gc.collect()  # the released storage is gone: the next repr puts torch's own back
print("REPR", repr(torch.zeros(1)), "TORCH'S BACK", torch.Tensor.__repr__ is TORCH_REPR)
"""


@pytest.mark.cpu
def test_a_released_tensor_reprs_safely_after_the_sanitizer_exited():
    result = run_isolated(code=AFTER_EXIT, timeout=240, cwd=ROOT, forkserver=True)
    out = result.stdout
    assert result.ok, f"{result.describe()}\n{out[-3000:]}\n{result.stderr[-4000:]}"
    assert "fixes.sanitize.ReleasedStorageError: aten.sum.default at <string>:8 in forward" in out
    assert "    x = tensor(<released storage>, size=(4, 8), dtype=torch.float32, device='cpu')" \
        in out, out
    assert "AFTER tensor(<released storage>, size=(4, 8)" in out, out
    assert "REGROWN tensor([[0., 0., 0., 0., 0., 0., 0., 0.]," in out, out
    assert "REPR tensor([0.]) TORCH'S BACK True" in out, out


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
                          '    seen["live"] = len(s._live); seen["main"] = scope.get("threads")')
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
    # (__repr__ stays wrapped while a released storage lives: test_a_released_tensor_reprs_...)
    tensor_methods = {n: torch.Tensor.__dict__.get(n) for n in ("tolist", "numpy")}
    bootstrap = threading.Thread.__dict__["_bootstrap_inner"]
    assert "resize_" not in torch.UntypedStorage.__dict__
    with pytest.raises(ValueError, match="boom"), storage_sanitizer():
        assert "resize_" in torch.UntypedStorage.__dict__
        assert torch._C._len_torch_dispatch_stack() == before_stack + 1
        raise ValueError("boom")
    assert "resize_" not in torch.UntypedStorage.__dict__
    assert {n: torch.Tensor.__dict__.get(n) for n in tensor_methods} == tensor_methods
    assert threading.Thread.__dict__["_bootstrap_inner"] is bootstrap
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
def test_a_tests_own_entry_joins_the_plugins_on_its_thread_only():
    from fixes.sanitize._callsite import entered_as

    with contextlib.ExitStack() as plugin:  # as the pytest plugin enters it around a test
        with entered_as("by the plugin", "mark the test", joinable=True):
            outer = plugin.enter_context(storage_sanitizer())
        with storage_sanitizer() as inner:  # the test's own: joins, undoes nothing on exit
            assert inner is outer
        assert "resize_" in torch.UntypedStorage.__dict__
        torch.randn(2).untyped_storage().resize_(0)  # the plugin's still records
        refused = []

        def elsewhere():
            try:
                with storage_sanitizer():
                    pass
            except RuntimeError as e:
                refused.append(str(e))

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert refused and "already active (entered by the plugin)" in refused[0]
    assert len(outer.releases) == 1 and "resize_" not in torch.UntypedStorage.__dict__


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


@pytest.mark.cpu
def test_a_triton_launch_on_released_memory_is_refused_before_it_runs():
    """A Triton kernel reads data_ptr() itself (no dispatcher call): its launch is checked.
    The tensor is on the CPU: a launch that got through would fail (no driver, or a CPU pointer
    on a GPU host), so nothing runs in this process."""
    require("triton")
    from triton_kernels import add_one

    h = torch.randn(4, 8)
    a, b = torch.chunk(h, 2, -1)
    with storage_sanitizer():
        a.untyped_storage().resize_(0)
        with pytest.raises(ReleasedStorageError, match=r"^triton kernel add_one at tests/"):
            add_one[(1,)](b, 16)


@pytest.mark.gpu
def test_a_triton_launch_on_released_cuda_memory_is_refused_before_it_runs():
    require("triton")
    # triton imported before the sanitizer is entered (the contract: the launch seam is
    # patched only on a triton already imported); the H200 run imported it inside the
    # sanitized block, and triton's own ValueError came first.
    code = ("from triton_kernels import add_one;"
            " a, b = torch.chunk(h, 2, -1); release(a); add_one[(1,)](b, 16)")
    child = CHILD.replace("import json, sys, threading, torch\n",
                          "import json, sys, threading, torch\nsys.path.insert(0, 'tests')\n"
                          "import triton_kernels\n")
    result = run_isolated(code=child, args=["cuda", json.dumps({"triton-launch": code})],
                          timeout=240, cwd=ROOT)
    assert result.ok, result.stderr[-4000:]
    case = json.loads(result.stdout.split("CASE ", 1)[1])["triton-launch"]
    assert case["error"] == "ReleasedStorageError", case
    assert case["op"] == "triton kernel add_one" and case["shape"] == [4, 4], case
