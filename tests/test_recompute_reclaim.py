"""The alias-aware recompute reclaim (fixes.megatron.reclaim).

Property tests run a Hypothesis batch inside ONE child interpreter per test (a wrong reclaim
reads freed memory: that must kill a child, not the pytest worker); the child only observes
storages through weak references (size 0 or expired = released), never by reading them.
Generated alias graphs: a base ``h``, a random chain of view ops to the checkpoint input, an
optional ``.data`` alias (make_viewless_tensor), readers that save an alias for a later
backward, aliases kept alive by the test, a module caching its recompute input (a reader), and
the recompute leak (Megatron-LM #3221 / #5227: the module keeps a recompute intermediate, whose
graph holds the checkpoint's detached input and its grad).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as tcp
from alias_ops import GRAD_VIEW_OPS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fixes.megatron import (
    apply_recompute_reclaim_patch,
    recompute_reclaim_events,
    remove_recompute_reclaim_patch,
)
from repro import run_isolated
from repro.harness.leaks import ModuleStateLeak
from repro.shared_view_reclaim import ViewlessAlias, install_reclaim
from repro.verl_release import missing_release

TARGET = tcp.CheckpointFunction
EXAMPLES = int(os.environ.get("STACKFIX_HYPOTHESIS_EXAMPLES", "500"))
settings.register_profile(
    "stackfix-reclaim", max_examples=EXAMPLES, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)



alias_graphs = st.fixed_dictionaries({
    "chain": st.lists(st.sampled_from(sorted(GRAD_VIEW_OPS)), min_size=0, max_size=4),
    "viewless": st.booleans(),
    # per chain position (0 = h itself): a reader saving it, created before the checkpoint
    "readers": st.lists(st.booleans(), min_size=5, max_size=5),
    "kept": st.lists(st.booleans(), min_size=5, max_size=5),
    "leak": st.booleans(),
    "cache": st.booleans(),
})


def _released(weak_storage) -> bool:
    if torch.UntypedStorage._expired(weak_storage):
        return True
    return torch.UntypedStorage._new_with_weak_ptr(weak_storage).nbytes() == 0


class _Leaks(ModuleStateLeak):
    """The recompute leak, plus what the invariants look at: weak refs to the leaked detached
    inputs, and the recompute inputs a module cached (readers)."""

    def __init__(self):
        super().__init__()
        self.copies: list = []
        self.cache: list = []

    def clear(self):
        super().clear()
        self.copies.clear()
        self.cache.clear()


def _step(graph, params, x, leaks):
    """One forward+backward; returns (weak ref of h's storage, kept aliases)."""
    proj, mix, seg = params
    h = proj(x)
    chain = [h]
    for op in graph["chain"]:
        chain.append(GRAD_VIEW_OPS[op](chain[-1]))
    loss = 0
    for i, t in enumerate(chain):
        if graph["readers"][i]:
            loss = loss + (t * mix).sum()  # MulBackward saves t: a later reader of h's storage
    inp = ViewlessAlias.apply(chain[-1]) if graph["viewless"] else chain[-1]

    def segment(t):
        out = seg(t).tanh()
        if graph["leak"] and torch.is_grad_enabled():  # the recompute keeps an intermediate
            leaks.keep(out)
            leaks.copies.append(weakref.ref(t))
        if graph["cache"] and torch.is_grad_enabled():  # a module caching its input: a reader
            leaks.cache.append(t)
        return out

    out = tcp.checkpoint(segment, inp, use_reentrant=True)
    kept = [t for i, t in enumerate(chain) if graph["kept"][i]]
    weak_h = h.untyped_storage()._weak_ref()
    del h, t, inp, chain
    (loss + out.square().sum()).backward()
    return weak_h, kept


def _params(device):
    torch.manual_seed(0)
    proj = nn.Linear(8, 8).to(device)
    mix = nn.Parameter(torch.tensor(1.5, device=device))
    seg = _Elementwise().to(device)
    return proj, mix, seg


class _Elementwise(nn.Module):
    # shape-agnostic (chains change the shape), with a parameter to get a gradient
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.7))

    def forward(self, t):
        return (t * self.w).sin()


def _grads(params):
    out = []
    for m in params:
        for p in ([m] if isinstance(m, nn.Parameter) else m.parameters()):
            out.append(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
            p.grad = None
    return out


def check_reclaim_invariants(graph, device="cpu"):
    """The invariants of one generated graph (runs in the child)."""
    params = _params(device)
    x = torch.randn(4, 8, device=device)
    leaks = _Leaks()
    remove_recompute_reclaim_patch(TARGET)
    _step(graph, params, x, leaks)
    reference = _grads(params)
    cached_ref = [t.detach().clone() for t in leaks.cache]
    leaks.clear()

    apply_recompute_reclaim_patch(TARGET)
    try:
        with recompute_reclaim_events() as events:
            weak_h, kept = _step(graph, params, x, leaks)
    finally:
        remove_recompute_reclaim_patch(TARGET)
    got = _grads(params)
    for g, r in zip(got, reference, strict=True):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6), "grads differ from the no-reclaim run"

    n_chain = len(graph["chain"]) + 1
    has_reader = any(graph["readers"][:n_chain])
    has_kept = bool(kept) or graph["cache"]
    input_events = [e.action for e in events if e.role == "input"]
    # 0. Nothing holds the detached copy after the recompute (no leak, no cache): nothing is
    # touched. Reference counting frees what only the checkpoint held, and kept aliases stay
    # readable (both checked in 2).
    if not (graph["leak"] or graph["cache"]):
        assert input_events == ["refcounted"], input_events
    # 1. Never released under a reader that has not run, or under a live outside alias.
    elif has_reader or has_kept:
        assert input_events[0] == "deferred", input_events
    # A view input keeps its base alive (another TensorImpl): deferred too. Only a viewless
    # input with nothing else on its storage is the checkpoint's alone: released right away.
    elif graph["viewless"]:
        assert input_events == ["released"], input_events
    # 2. By the end of the pass: released unless the test still holds an alias of it.
    if has_kept:
        assert not _released(weak_h), "storage released under a live alias"
        assert all(t.untyped_storage().nbytes() > 0 for t in kept + leaks.cache)
        for t, ref in zip(leaks.cache, cached_ref, strict=True):
            assert torch.equal(t.detach(), ref) and t.grad is not None  # readable, grad kept
    else:
        assert _released(weak_h), f"storage only the checkpoint owned was not released: {events}"
    # 3. The leak: the leaked detached input (and its grad) lost their memory all the same.
    if graph["leak"] and not has_kept:
        (copy,) = [ref() for ref in leaks.copies]
        assert copy is not None and copy.untyped_storage().nbytes() == 0
        assert copy.grad is None or copy.grad.untyped_storage().nbytes() == 0


@settings(settings.get_profile("stackfix-reclaim"))
@given(alias_graphs)
def _property_batch_cpu(graph):
    check_reclaim_invariants(graph, "cpu")


@settings(settings.get_profile("stackfix-reclaim"))
@given(alias_graphs)
def _property_batch_cuda(graph):
    check_reclaim_invariants(graph, "cuda")


def _run_batch_in_child(device: str, examples: int):
    code = (
        f"import gc, sys; gc.disable(); sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_recompute_reclaim as t\n"
        f"t._property_batch_{device}()\n"
        "print('BATCH-OK')\n"
    )
    r = run_isolated(code=code, timeout=600, env={"STACKFIX_HYPOTHESIS_EXAMPLES": str(examples)},
                     cwd=str(Path(__file__).parent.parent), forkserver=True)
    assert r.ok and "BATCH-OK" in r.stdout, f"{r.describe()}\n{r.stderr[-4000:]}"


# The CPU batch in shards, one child each, so xdist workers run them side by side: the same
# number of generated graphs in all, each shard drawing its own (derandomize is off).
CPU_SHARDS = 4


@pytest.mark.cpu
@pytest.mark.parametrize("shard", range(CPU_SHARDS))
def test_generated_alias_graphs_cpu(shard):
    _run_batch_in_child("cpu", -(-EXAMPLES // CPU_SHARDS))


@pytest.mark.gpu
def test_generated_alias_graphs_cuda():
    _run_batch_in_child("cuda", min(EXAMPLES, 200))


@pytest.mark.cpu
def test_the_batch_catches_verls_reclaim_mechanism():
    # The same invariants must fail under verl's reclaim mechanism (resize_(0) every input, put
    # on torch's checkpoint by repro.shared_view_reclaim): the child dies or asserts.
    code = (
        f"import gc, sys; gc.disable(); sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_recompute_reclaim as t\n"
        "t.apply_recompute_reclaim_patch = lambda target: t.install_reclaim('resize-all', target)\n"
        "g = dict(chain=['chunk'], viewless=True, readers=[True] + [False] * 4,"
        " kept=[False] * 5, leak=False, cache=False)\n"
        "t.check_reclaim_invariants(g)\n"
    )
    r = run_isolated(code=code, timeout=300, cwd=str(Path(__file__).parent.parent), forkserver=True)
    assert not r.ok and (r.signal is not None or "AssertionError" in r.stderr), r.describe()


@pytest.mark.cpu
def test_leaked_recompute_input_is_released_at_once():
    # In-process (no reader, nothing shared: nothing can read freed memory).
    graph = dict(chain=[], viewless=True, readers=[False] * 5, kept=[False] * 5, leak=True,
                 cache=False)
    params, x, leaks = _params("cpu"), torch.randn(4, 8), _Leaks()
    try:
        # Without the reclaim the kept intermediate's graph keeps the detached input and its
        # grad: the leak the reclaim exists for.
        _step(graph, params, x, leaks)
        (copy,) = [ref() for ref in leaks.copies]
        assert copy.untyped_storage().nbytes() == 4 * 8 * 4
        assert copy.grad is not None and copy.grad.untyped_storage().nbytes() == 4 * 8 * 4
        del copy
        leaks.clear()
        apply_recompute_reclaim_patch(TARGET)
        with recompute_reclaim_events() as events:
            _step(graph, params, x, leaks)
        (copy,) = [ref() for ref in leaks.copies]
        assert copy.untyped_storage().nbytes() == 0, events  # alive, memory gone
        # The grad was handed to autograd, never resized; the leaked copy no longer holds it,
        # so reference counting freed it once the previous layer had consumed it.
        assert copy.grad is None, events
        (grad_event,) = [e for e in events if e.role == "grad"]
        assert grad_event.action == "dropped" and grad_event.nbytes == 4 * 8 * 4
        assert [e.action for e in events if e.role == "input"] == ["released"]
    finally:
        remove_recompute_reclaim_patch(TARGET)


@pytest.mark.cpu
def test_patch_is_idempotent_and_undo_restores_the_original():
    original = TARGET.__dict__["backward"]
    try:
        assert apply_recompute_reclaim_patch(TARGET) is True
        wrapped = TARGET.__dict__["backward"]
        assert apply_recompute_reclaim_patch(TARGET) is False
        assert TARGET.__dict__["backward"] is wrapped
        assert wrapped.__func__.__wrapped__ is original.__func__  # wrapped, not copied
        install_reclaim("resize-all", TARGET)  # replaces ours, one at a time
        assert TARGET.__dict__["backward"].__func__.__wrapped__ is original.__func__
        assert remove_recompute_reclaim_patch(TARGET) is False
        install_reclaim("none", TARGET)
        assert TARGET.__dict__["backward"] is original
        assert remove_recompute_reclaim_patch(TARGET) is False
    finally:
        install_reclaim("none", TARGET)
    assert TARGET.__dict__["backward"] is original


@pytest.mark.cpu
def test_megatron_patch_is_idempotent_and_undo_restores_the_original():
    mrandom = pytest.importorskip("megatron.core.tensor_parallel.random",
                                  reason="megatron-core not installed")
    cls = mrandom.CheckpointFunction
    original = cls.__dict__["backward"]
    try:
        assert apply_recompute_reclaim_patch() is True
        assert apply_recompute_reclaim_patch() is False
        assert cls.__dict__["backward"].__func__.__wrapped__ is original.__func__
        assert remove_recompute_reclaim_patch() is True
        assert cls.__dict__["backward"] is original
    finally:
        remove_recompute_reclaim_patch()


# --- GPU memory-safety oracle: compute-sanitizer memcheck -------------------------------------------------------

SANITIZER = shutil.which("compute-sanitizer") or (
    "/usr/local/cuda/bin/compute-sanitizer"
    if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None
)


# compute-sanitizer records a host backtrace for the CUDA calls it tracks, and on this Python that
# backtrace keeps the calling Python frames alive (H200, compute-sanitizer 2025.3.1, its default
# ``--show-backtrace yes``): the frames of the step's recompute outlive it, and their locals
# reference the checkpoint's inputs. The reclaim never frees what a Python reference can still
# reach, so under host backtraces it keeps the shared input (events ``input:deferred input:kept``)
# and memcheck's "0 errors" covers no release. With host backtraces off (``device``: the device
# backtrace of a precise error is still printed) the decisions are the plain run's
# (benchmarks/results/h200-2026-11-30-round4/probe-*.log), and every memcheck test below asserts,
# through recompute_reclaim_events, that memory was released. API errors are not reported: a real
# megatron-core MoE step makes 8 failing cudaFuncGetAttributes / cudaGetLastError probes
# (cudaErrorNoKernelImageForDevice) that its ops survive; what these tests check is memory access.
MEMCHECK = ("--tool", "memcheck", "--show-backtrace", "device", "--report-api-errors", "no")


def _under_memcheck(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args`` under compute-sanitizer memcheck, from the repository root."""
    return subprocess.run(
        [SANITIZER, *MEMCHECK, sys.executable, "-m", module, *args],
        capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).parent.parent),
    )


# the shared-view repros: torch only, and megatron-core with verl 0.8.0's / 0.9.1's released patch
SHARED_VIEW_REPROS = ["shared-view-reclaim", "shared-view-reclaim-verl080",
                      "shared-view-reclaim-verl091"]


def _memcheck(name: str, mode: str) -> subprocess.CompletedProcess:
    return _under_memcheck("repro.child", name, mode, "--device", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", SHARED_VIEW_REPROS)
def test_compute_sanitizer_memcheck_fixed_path_releases(name):
    _skip_unless_memcheck_can_run(name)
    fixed = _memcheck(name, "--fixed")
    out = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    # 0 errors must come from a run that released memory: the shared chunk view's storage,
    # resize_(0)'d after its last reader (under memcheck too, the decision is the plain run's).
    (line,) = [ln for ln in fixed.stdout.splitlines() if ln.startswith("reclaim events:")]
    assert "input:released-deferred" in line, line


@pytest.mark.gpu
def test_compute_sanitizer_memcheck_real_moe_step_with_releases():
    """The release path itself under memcheck: a real megatron-core MoE GPT (4 layers, full
    recompute, the #3221 leak) trained one step with the alias-aware reclaim releases its
    checkpoints' inputs at once (``input:released``: nothing else holds them), and memcheck
    reports no error."""
    _need_sanitizer()
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    r = _under_memcheck("benchmarks.megatron_scale", "--child", "moe", "ours", "--device", "cuda",
                        "--sizes", "256x256", "--dtypes", "fp32", "--steps", "1")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("CELLS ")]
    (cell,) = json.loads(line[len("CELLS "):])
    assert cell["error"] is None, cell["error"]
    assert cell["events"].get("input:released", 0) >= 1, cell["events"]
    assert "input:kept" not in cell["events"], cell["events"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", SHARED_VIEW_REPROS)
def test_compute_sanitizer_catches_the_unfixed_reclaim(name):
    _skip_unless_memcheck_can_run(name)
    unfixed = _memcheck(name, "--unfixed")
    out = unfixed.stdout + unfixed.stderr
    assert "ERROR SUMMARY: 0 errors" not in out and "Invalid __global__" in out, out[-4000:]


def _need_sanitizer() -> None:
    if SANITIZER is None:
        pytest.skip("compute-sanitizer not found (PATH, /usr/local/cuda/bin)")


def _skip_unless_memcheck_can_run(name: str) -> None:
    _need_sanitizer()
    if "-verl" in name:
        pytest.importorskip("megatron.core", reason="megatron-core not installed")
        _need_verl("0.8.0" if name.endswith("080") else "0.9.1")


def _need_verl(version: str) -> None:
    why = missing_release(version)
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("fixed", [False, True], ids=["verl-0.8.0", "alias-aware"])
def test_megatron_gpt_mtp_finding_chunked_mtp_input_is_not_read_after_its_backward(fixed):
    """A recorded finding, kept under test (H200, megatron-core 0.19.2, 2026-11-30): a real
    GPT + MTP (local spec, full recompute) feeds the MTP layer a viewless torch.chunk of the
    decoder output, yet verl 0.8.0's reclaim does NOT crash it and the grads equal the
    no-reclaim run: nothing reads that storage after the MTP checkpoint's backward. If a
    megatron-core release makes verl's path fail here, promote it to a repro."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    _need_verl("0.8.0")
    code = (
        "from repro.shared_view_reclaim import run_megatron_mtp\n"
        f"run_megatron_mtp({fixed}, 'cuda')\n"
    )
    r = run_isolated(code=code, timeout=300, cwd=str(Path(__file__).parent.parent))
    assert r.ok, f"{r.describe()}\n{r.stderr[-3000:]}"
    assert "reclaim events:" in r.stdout
