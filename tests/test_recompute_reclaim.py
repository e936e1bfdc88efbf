"""The recompute reclaim (fixes.megatron.reclaim): generated alias graphs.

Property tests run a Hypothesis batch inside ONE child interpreter per shard (a wrong reclaim
would read freed memory: that must kill a child, not the pytest worker); the child observes
storages through weak references only (expired or size 0 = gone), never by reading them.
Generated graphs: a base ``h``, a random chain of view ops to the checkpoint input, an optional
``.data`` alias (make_viewless_tensor), one to three views of that storage passed to the same
checkpoint, readers that save an alias for a later backward, aliases kept alive by the test, a
module caching its recompute input, a side result built during the recompute and backwarded
after the main backward (a pending node that saved the copy), a reference cycle holding the
copy, a nested checkpoint, gradient accumulation over micro-batches, ``retain_graph`` with a
second backward, collections during the recompute (objects promoted to the oldest generation),
and the recompute leak (Megatron-LM #3221 / #5227: the module keeps a recompute intermediate,
whose graph holds the checkpoint's detached input and its grad).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import weakref
from contextlib import nullcontext
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
from repro.harness.leaks import ModuleStateLeak, PythonCycle
from repro.shared_view_reclaim import ViewlessAlias, install_reclaim, storage_gone
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
    "views": st.integers(1, 3),  # checkpoint inputs on the one storage
    # per chain position (0 = h itself): a reader saving it, created before the checkpoint
    "readers": st.lists(st.booleans(), min_size=5, max_size=5),
    "kept": st.lists(st.booleans(), min_size=5, max_size=5),
    "leak": st.booleans(),
    "cache": st.booleans(),
    "side": st.booleans(),
    "cycle": st.booleans(),
    "nested": st.booleans(),
    "micro_batches": st.integers(1, 2),
    "retain": st.booleans(),
    "collect": st.booleans(),
})


class _Holders(ModuleStateLeak):
    """The recompute leak, plus the other holders of the detached copy a graph may have: a
    module cache (readers), side results kept for a later backward, reference cycles."""

    def __init__(self):
        super().__init__()
        self.copies: list = []
        self.cache: list = []
        self.side: list = []

    def clear(self):
        super().clear()
        self.copies.clear()
        self.cache.clear()
        self.side.clear()


def _segment(graph, seg, holders):
    def body(*inputs):
        t = inputs[0] * 1.0 if len(inputs) == 1 else sum(x.sum() for x in inputs) + inputs[0]
        out = seg(t).tanh()
        if torch.is_grad_enabled():  # the recompute (the checkpointed forward runs in no_grad)
            holders.copies.extend(weakref.ref(x) for x in inputs)
            if graph["leak"]:
                holders.keep(out)
            if graph["cache"]:
                holders.cache.append(inputs[0])
            if graph["side"]:
                holders.side.append((inputs[-1] * seg.w).sum())  # saves the copy and w
            if graph["cycle"]:
                PythonCycle(inputs[0])
            if graph["collect"]:
                gc.collect(1)  # what is reachable now is promoted to the oldest generation
        return out

    if not graph["nested"]:
        return body
    return lambda *inputs: tcp.checkpoint(body, *inputs, use_reentrant=True)


def _inputs(graph, last):
    """The checkpoint's inputs: ``last`` and up to two more views of its storage."""
    extra = [last[..., :1], last.t()][: graph["views"] - 1]
    return [last, *extra]


def _step(graph, params, x, holders):
    """Micro-batches of forward + backward (+ the side results' backward); returns (weak ref of
    h's storage, kept aliases)."""
    proj, mix, seg = params
    weak_h, kept = None, []
    for _ in range(graph["micro_batches"]):
        h = proj(x)
        chain = [h]
        for op in graph["chain"]:
            chain.append(GRAD_VIEW_OPS[op](chain[-1]))
        loss = 0
        for i, t in enumerate(chain):
            if graph["readers"][i]:
                loss = loss + (t * mix).sum()  # MulBackward saves t: a later reader of h's storage
        last = ViewlessAlias.apply(chain[-1]) if graph["viewless"] else chain[-1]
        out = tcp.checkpoint(_segment(graph, seg, holders), *_inputs(graph, last),
                             use_reentrant=True)
        kept = [t for i, t in enumerate(chain) if graph["kept"][i]]
        weak_h = h.untyped_storage()._weak_ref()
        del h, t, last, chain
        total = loss + out.square().sum()
        if graph["retain"]:
            total.backward(retain_graph=True)
        total.backward()
        del total, out, loss
        for side in holders.side:
            side.backward()  # reads the recompute's copy of the input
        holders.side.clear()
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


def check_reclaim_invariants(graph, device="cpu", sanitize=False):
    """The invariants of one generated graph (runs in the child)."""
    from fixes.sanitize import storage_sanitizer

    params = _params(device)
    x = torch.randn(4, 8, device=device)
    holders = _Holders()
    remove_recompute_reclaim_patch(TARGET)
    _step(graph, params, x, holders)
    reference = _grads(params)
    cached_ref = [t.detach().clone() for t in holders.cache]
    holders.clear()
    if graph["cycle"]:
        gc.collect()  # the reference run's cycles (a full collection: they may have been promoted)

    apply_recompute_reclaim_patch(TARGET)
    try:
        with recompute_reclaim_events() as events, (storage_sanitizer() if sanitize
                                                    else nullcontext()):
            weak_h, kept = _step(graph, params, x, holders)
    finally:
        remove_recompute_reclaim_patch(TARGET)
    # 1. No reader saw a wrong value: grads equal the no-reclaim run's, caches readable.
    got = _grads(params)
    for g, r in zip(got, reference, strict=True):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6), "grads differ from the no-reclaim run"
    for t, ref in zip(holders.cache, cached_ref, strict=True):
        assert torch.equal(t.detach(), ref) and t.grad is not None  # readable, grad kept
    # 2. Nothing is ever resized: every alias the test kept still has all its memory.
    assert all(t.untyped_storage().nbytes() > 0 for t in kept)
    actions = {e.action for e in events}
    assert actions <= {"refcounted", "detached", "kept", "dropped"}, actions
    # 3. The decision per copy: nothing but the checkpoint held it -> left to reference
    # counting; only a leaked graph -> detached; a reader (cache, side result, cycle) -> kept.
    outer = [e.action for e in events if e.role == "input"]
    reader = graph["cache"] or graph["side"] or graph["cycle"] or graph["collect"]
    if not graph["nested"] and not reader:
        expected = "detached" if graph["leak"] else "refcounted"
        assert set(outer) == {expected}, outer
    if graph["cache"] or graph["side"] or (graph["cycle"] and not graph["collect"]):
        assert "kept" in outer, outer  # (a collection in the recompute collects the cycle)
    # 4. The leak's memory: gone once no real reader remains (a cycle: once collected). A copy
    # kept for a reader that held it at the checkpoint's backward (a side result, a cycle not yet
    # collected) stays with the leak until the leak goes (the module's next forward).
    if graph["cycle"]:
        gc.collect()  # full: a cycle promoted to the oldest generation goes only with it
    read_at_backward = graph["side"] or (graph["cycle"] and not graph["collect"])
    if not (kept or graph["cache"] or (graph["leak"] and read_at_backward)):
        assert storage_gone(weak_h), f"the leak kept memory no reader holds: {events}"
    if graph["leak"] and not reader and not graph["nested"]:
        for ref in holders.copies:
            copy = ref()  # alive (the leaked graph holds it), its memory let go
            assert copy is not None and copy.grad is None
            assert copy.untyped_storage().nbytes() == copy.element_size()
    holders.clear()


@settings(settings.get_profile("stackfix-reclaim"))
@given(alias_graphs)
def _property_batch_cpu(graph):
    check_reclaim_invariants(graph, "cpu", sanitize=os.environ.get("STACKFIX_SANITIZE_BATCH") == "1")


@settings(settings.get_profile("stackfix-reclaim"))
@given(alias_graphs)
def _property_batch_cuda(graph):
    check_reclaim_invariants(graph, "cuda", sanitize=os.environ.get("STACKFIX_SANITIZE_BATCH") == "1")


def _run_batch_in_child(device: str, examples: int, gc_enabled: bool = True,
                        sanitize: bool = False):
    code = (
        f"import gc, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        + ("" if gc_enabled else "gc.disable()\n")
        + "import test_recompute_reclaim as t\n"
        # The imports' heap (torch, hypothesis, sympy) into the permanent generation: the full
        # collections the invariants take (cycles, promoted or not) then scan only what the
        # examples made -- 49 ms each otherwise, 80% of the batch's time on CPU.
        "gc.collect(); gc.freeze()\n"
        f"t._property_batch_{device}()\n"
        "print('BATCH-OK')\n"
    )
    env = {"STACKFIX_HYPOTHESIS_EXAMPLES": str(examples),
           "STACKFIX_SANITIZE_BATCH": "1" if sanitize else "0"}
    r = run_isolated(code=code, timeout=600, env=env, cwd=str(Path(__file__).parent.parent),
                     forkserver=True)
    assert r.ok and "BATCH-OK" in r.stdout, f"{r.describe()}\n{r.stderr[-4000:]}"


# The CPU batch in shards, one child each, so xdist workers run them side by side: the same
# number of generated graphs in all, each shard drawing its own (derandomize is off). The cycle
# collector on or off, and fixes.sanitize.storage_sanitizer() around the steps or not.
CPU_SHARDS = [(True, False), (True, True), (False, False), (False, True)]


@pytest.mark.cpu
@pytest.mark.parametrize(("gc_enabled", "sanitize"), CPU_SHARDS,
                         ids=[f"gc-{'on' if g else 'off'}{'-sanitized' if s else ''}"
                              for g, s in CPU_SHARDS])
def test_generated_alias_graphs_cpu(gc_enabled, sanitize):
    _run_batch_in_child("cpu", -(-EXAMPLES // len(CPU_SHARDS)), gc_enabled, sanitize)


@pytest.mark.gpu
def test_generated_alias_graphs_cuda():
    _run_batch_in_child("cuda", min(EXAMPLES, 200))


def plain_graph(**changes) -> dict:
    """A graph of ``alias_graphs``' shape with nothing in it but ``changes``."""
    graph = dict(chain=[], viewless=False, views=1, readers=[False] * 5, kept=[False] * 5,
                 leak=False, cache=False, side=False, cycle=False, nested=False,
                 micro_batches=1, retain=False, collect=False)
    graph.update(changes)
    return graph


@pytest.mark.cpu
def test_the_batch_catches_verls_reclaim_mechanism():
    # The same invariants must fail under verl's reclaim mechanism (resize_(0) every input, put
    # on torch's checkpoint by repro.shared_view_reclaim): the child dies or asserts.
    code = (
        f"import gc, sys; gc.disable(); sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_recompute_reclaim as t\n"
        "t.apply_recompute_reclaim_patch = lambda target: t.install_reclaim('resize-all', target)\n"
        "g = t.plain_graph(chain=['chunk'], viewless=True, readers=[True] + [False] * 4)\n"
        "t.check_reclaim_invariants(g)\n"
    )
    r = run_isolated(code=code, timeout=300, cwd=str(Path(__file__).parent.parent), forkserver=True)
    assert not r.ok and (r.signal is not None or "AssertionError" in r.stderr), r.describe()


@pytest.mark.cpu
def test_leaked_recompute_input_is_let_go_at_once():
    # In-process (no reader, nothing shared: nothing can read freed memory).
    graph = plain_graph(viewless=True, leak=True)
    params, x, holders = _params("cpu"), torch.randn(4, 8), _Holders()
    try:
        # Without the reclaim the kept intermediate's graph keeps the detached input and its
        # grad: the leak the reclaim exists for.
        weak_h, _ = _step(graph, params, x, holders)
        (copy,) = [ref() for ref in holders.copies]
        assert copy.untyped_storage().nbytes() == 4 * 8 * 4 and not storage_gone(weak_h)
        assert copy.grad is not None and copy.grad.untyped_storage().nbytes() == 4 * 8 * 4
        del copy
        holders.clear()
        apply_recompute_reclaim_patch(TARGET)
        with recompute_reclaim_events() as events:
            weak_h, _ = _step(graph, params, x, holders)
        (copy,) = [ref() for ref in holders.copies]
        assert storage_gone(weak_h), events  # the input's memory went with its last holder
        assert copy.untyped_storage().nbytes() == copy.element_size()  # alive, a placeholder
        # The grad was handed back to autograd; the leaked copy no longer holds it, so
        # reference counting freed it once the previous layer had consumed it.
        assert copy.grad is None, events
        (grad_event,) = [e for e in events if e.role == "grad"]
        assert grad_event.action == "dropped" and grad_event.nbytes == 4 * 8 * 4
        assert [e.action for e in events if e.role == "input"] == ["detached"]
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
    # 0 errors must come from a run that let the leak go: the leaked chunk view's copy
    # detached, so the shared storage went after its last reader (the repro checks it).
    (line,) = [ln for ln in fixed.stdout.splitlines() if ln.startswith("reclaim events:")]
    assert "input:detached" in line, line


@pytest.mark.gpu
def test_compute_sanitizer_memcheck_real_moe_step_with_releases():
    """The reclaim's path itself under memcheck: a real megatron-core MoE GPT (4 layers, full
    recompute, the #3221 leak) trained one step with the reclaim detaches its checkpoints'
    leaked copies (``input:detached``: nothing else holds them), and memcheck reports no
    error."""
    _need_sanitizer()
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    r = _under_memcheck("benchmarks.megatron_scale", "--child", "moe", "ours", "--device", "cuda",
                        "--sizes", "256x256", "--dtypes", "fp32", "--steps", "1")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("CELLS ")]
    (cell,) = json.loads(line[len("CELLS "):])
    assert cell["error"] is None, cell["error"]
    assert cell["events"].get("input:detached", 0) >= 1, cell["events"]
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
