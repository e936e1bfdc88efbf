"""Crash 1 (mesh lost in checkpoint recompute): the thread-placement matrix and the fixes'
mechanism -- which thread recompute ran on, which mesh it saw, that it ran the same ops, that
the caller's mesh state is left as it was, and that single_threaded_backward restores autograd's
setting. The unfixed / fixed contract of the repros themselves is tests/test_repros.py.

The matrix runs in a child interpreter (``python -m repro.mesh_recompute --matrix``): the
unfixed cells raise SpmdTypeError, and crashes are never run in the test process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import spmd_types as spmd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from fixes.torchtitan import (
    make_checkpoint_wrappers_mesh_preserving,
    mesh_preserving,
    mesh_preserving_context_fn,
    single_threaded_backward,
)
from fixes.torchtitan.backward_threads import SingleThreadedBackwardUnavailable
from repro import run_isolated
from repro.harness.optional import require
from repro.harness.spmd_mesh import spmd_mesh
from repro.mesh_recompute import (
    FIXES,
    N_BLOCKS,
    PLACEMENTS,
    Probe,
    TypedBlock,
    torchtitan_style_policy,
)

ERROR_FRAGMENT = "requires an active mesh"  # shared by spmd_types 0.2.3 and 0.3.x wording


# --------------------------------------------------------------------------- the matrix


@functools.cache
def _matrix(device: str) -> dict:
    result = run_isolated(module="repro.mesh_recompute", args=["--matrix", "--device", device],
                          timeout=300, forkserver=True)
    assert result.ok, f"matrix child failed: {result.describe()}\n{result.stderr[-4000:]}"
    cells = [json.loads(line[5:]) for line in result.stdout.splitlines()
             if line.startswith("CELL ")]
    return {(c["placement"], c["ac"], c["fix"]): c for c in cells}


def _expect_crash(placement: str, fix: str, device: str) -> bool:
    if fix == "context_fn":
        return False  # the fix holds everywhere, multithreading left on
    if placement in ("main", "worker"):
        return True  # backward outside the mesh context: no thread setting helps
    # Step inside the mesh: only CUDA moves backward to a device thread, and only the
    # per-step single-threading (not the main thread's init-time one) keeps it on the step thread.
    return device == "cuda" and fix == "none"


MATRIX = [
    pytest.param(device, placement, ac, fix, id=f"{device}-{placement}-{ac}-{fix}",
                 marks=pytest.mark.cpu if device == "cpu" else pytest.mark.gpu)
    for device in ("cpu", "cuda")
    for placement in PLACEMENTS
    for ac in ("selective", "full")
    for fix in FIXES
]


@pytest.mark.parametrize("device,placement,ac,fix", MATRIX)
def test_thread_placement_matrix(device, placement, ac, fix):
    cell = _matrix(device)[(placement, ac, fix)]
    main, fwd, caller = cell["main_thread"], cell["forward_thread"], cell["backward_caller"]

    # Where the driver put forward and backward.
    if placement == "main":
        assert fwd == caller == main
    elif placement == "worker":
        assert fwd == main and caller != main
    elif placement == "init-thread":
        assert fwd == caller != main  # multithreading was turned off on main, the step is not
    else:
        assert fwd == caller == main

    # Where recompute ran: the caller's thread unless CUDA autograd moved it to a device
    # thread, which single_threaded_backward (on the step's thread) prevents.
    on_caller = device == "cpu" or fix == "single_threaded_backward"
    assert cell["recompute"], "no block was recomputed"
    for call in cell["recompute"]:
        assert (call["thread"] == caller) is on_caller, cell["recompute"]

    caller_mesh = cell["caller_mesh_before"]
    assert caller_mesh == (None if placement in ("main", "worker") else ["tp"])
    assert cell["caller_mesh_after"] == caller_mesh  # nothing leaked into the caller's thread

    if _expect_crash(placement, fix, device):
        assert cell["error"] is not None, "expected the crash"
        assert "SpmdTypeError" in cell["error"]["types"]
        assert ERROR_FRAGMENT in cell["error"]["message"]
        assert cell["recompute"][-1]["mesh"] is None  # the mechanism: recompute had no mesh
        return
    assert cell["error"] is None, cell["error"]
    assert cell["grads_equal"] is True  # bit-equal to no AC (fp32)
    assert len(cell["recompute"]) == N_BLOCKS
    assert all(call["mesh"] == ["tp"] for call in cell["recompute"])
    # x's grad hook runs after both blocks' backward, on the recompute thread: the forward's
    # mesh is gone again, and that thread's own state (none, or the step's mesh) is back.
    after = cell["after_recompute"]
    assert after["thread"] == cell["recompute"][-1]["thread"]
    expected_after = caller_mesh if on_caller else None  # a device thread owns no mesh
    assert after["mesh"] == expected_after


# --------------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def mesh():
    return spmd_mesh()


def _mesh_names():
    names = spmd.current_mesh_all_names()
    return None if names is None else sorted(names)


def _blocks(n=N_BLOCKS):
    torch.manual_seed(0)
    probe = Probe()
    blocks = torch.nn.ModuleList(TypedBlock(probe) for _ in range(n))
    x = torch.randn(8, 16, requires_grad=True)
    return blocks, x, probe


def _loss(blocks, x, context_fn=None):
    for block in blocks:
        if context_fn is None:
            x = block(x)
        else:
            x = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    return x.pow(2).sum()


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(context_fn, mesh, backward_in_mesh):
    blocks, x, _ = _blocks()
    with spmd.set_current_mesh(mesh):
        loss = _loss(blocks, x, context_fn)
    counter = OpCounter()
    outer = spmd.set_current_mesh(mesh) if backward_in_mesh else contextlib.nullcontext()
    with outer, counter:
        loss.backward()
    return counter.ops


PLAIN_AND_FIXED = {
    "selective": (lambda: create_selective_checkpoint_contexts(torchtitan_style_policy()),
                  lambda: mesh_preserving_context_fn(torchtitan_style_policy())),
    "full": (lambda: (contextlib.nullcontext(), contextlib.nullcontext()),
             mesh_preserving_context_fn),
}


@pytest.mark.cpu
@pytest.mark.parametrize("ac", ["selective", "full"])
def test_recompute_runs_the_same_ops_as_plain_ac(ac, mesh):
    plain, fixed = PLAIN_AND_FIXED[ac]
    reference = _backward_ops(plain, mesh, backward_in_mesh=True)  # plain AC, mesh still set
    assert _backward_ops(fixed, mesh, backward_in_mesh=True) == reference
    assert _backward_ops(fixed, mesh, backward_in_mesh=False) == reference
    no_ac = _backward_ops(None, mesh, backward_in_mesh=True)
    # Recompute really happened: the backward re-ran each block's forward silu (no AC's does
    # not), and full AC also re-ran the matmul that the selective policy saved.
    assert reference["aten.silu.default"] == N_BLOCKS and no_ac["aten.silu.default"] == 0
    if ac == "full":
        selective = _backward_ops(PLAIN_AND_FIXED["selective"][0], mesh, backward_in_mesh=True)
        assert reference["aten.mm.default"] == selective["aten.mm.default"] + N_BLOCKS


def _recorder(log):
    """A checkpointable function that records the mesh it sees (no assert: it may run meshless)."""
    w = torch.randn(16, 16, requires_grad=True)

    def fn(x):
        log.append((threading.get_ident(), _mesh_names()))
        return torch.tanh(x @ w)

    return fn, w


@pytest.mark.cpu
def test_no_mesh_at_forward_is_exactly_the_wrapped_policy(mesh):
    fwd, rec = mesh_preserving_context_fn(torchtitan_style_policy())
    plain_fwd, plain_rec = create_selective_checkpoint_contexts(torchtitan_style_policy())
    assert type(fwd) is type(plain_fwd) and type(rec) is type(plain_rec)
    assert all(isinstance(c, contextlib.nullcontext) for c in mesh_preserving_context_fn())
    # ... so recompute sees whatever mesh the backward has, as it would without the fix.
    for context_fn in (mesh_preserving_context_fn, PLAIN_AND_FIXED["full"][0]):
        log = []
        fn, _ = _recorder(log)
        loss = checkpoint(fn, torch.randn(4, 16), use_reentrant=False,
                          context_fn=context_fn).sum()
        with spmd.set_current_mesh(mesh):
            loss.backward()
        assert [m for _, m in log] == [None, ["tp"]]


@pytest.mark.cpu
def test_explicit_mesh_is_entered_in_recompute(mesh):
    log = []
    fn, w = _recorder(log)
    context_fn = functools.partial(mesh_preserving_context_fn, mesh=mesh)
    loss = checkpoint(fn, torch.randn(4, 16), use_reentrant=False, context_fn=context_fn).sum()
    loss.backward()
    assert [m for _, m in log] == [None, ["tp"]]
    assert _mesh_names() is None and w.grad is not None


@pytest.mark.cpu
def test_recompute_uses_the_forward_mesh_not_the_callers(mesh):
    other = spmd_mesh("dp")  # a different mesh, current on the thread that calls backward
    log = []
    fn, _ = _recorder(log)
    with spmd.set_current_mesh(mesh):
        loss = checkpoint(fn, torch.randn(4, 16), use_reentrant=False,
                          context_fn=mesh_preserving_context_fn).sum()
    with spmd.set_current_mesh(other):
        loss.backward()
        assert _mesh_names() == ["dp"]  # the caller's own mesh is back
    assert [m for _, m in log] == [["tp"], ["tp"]]


@pytest.mark.cpu
def test_mesh_state_restored_after_retain_graph_and_after_a_failing_recompute(mesh):
    log = []
    fn, _ = _recorder(log)
    x = torch.randn(4, 16, requires_grad=True)
    with spmd.set_current_mesh(mesh):
        loss = checkpoint(fn, x, use_reentrant=False, context_fn=mesh_preserving_context_fn).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # recompute context entered a second time
    assert [m for _, m in log] == [["tp"], ["tp"], ["tp"]]
    assert _mesh_names() is None

    def fails_in_recompute(x):
        if torch._C._current_graph_task_id() != -1:  # inside backward: this is the recompute
            raise RuntimeError("boom in recompute")
        return x.sin()

    with spmd.set_current_mesh(mesh):
        loss = checkpoint(fails_in_recompute, x, use_reentrant=False,
                          context_fn=mesh_preserving_context_fn).sum()
    with pytest.raises(RuntimeError, match="boom in recompute"):
        loss.backward()
    assert _mesh_names() is None  # the forward's mesh did not stay on this thread
    with spmd.set_current_mesh(mesh):  # an outer mesh of the caller is kept, not replaced
        with pytest.raises(RuntimeError, match="boom in recompute"):
            checkpoint(fails_in_recompute, x, use_reentrant=False,
                       context_fn=mesh_preserving_context_fn).sum().backward()
        assert _mesh_names() == ["tp"]
    assert _mesh_names() is None


@pytest.mark.cpu
@pytest.mark.parametrize("ac", ["selective", "full"])
def test_under_torch_compile(ac, mesh):
    """torch.compile demands TorchDispatchModes from a non-default context_fn (full AC's
    nullcontexts are swapped for pass-through modes). A fullgraph region compiles; the typed
    block (assert_type breaks the graph, so it runs eagerly) keeps the mesh in recompute."""
    context_fn = PLAIN_AND_FIXED[ac][1]
    w = torch.randn(16, 16, requires_grad=True)

    def plain(x):
        return torch.tanh(torch.tanh(x @ w) @ w).sum()

    def checkpointed(x):
        inner = lambda x: torch.tanh(torch.tanh(x @ w) @ w)  # noqa: E731
        return checkpoint(inner, x, use_reentrant=False, context_fn=context_fn).sum()

    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(plain(x), (x, w))
    got = torch.autograd.grad(torch.compile(checkpointed, backend="aot_eager", fullgraph=True)(x),
                              (x, w))
    assert all(torch.allclose(a, b) for a, b in zip(got, expected, strict=True))

    blocks, x, probe = _blocks(1)
    reference = _reference_grads(mesh, n=1)
    compiled = torch.compile(lambda x: _loss(blocks, x, context_fn), backend="aot_eager")
    with spmd.set_current_mesh(mesh):
        loss = compiled(x)
    loss.backward()
    assert probe.calls[-1]["mesh"] == ["tp"] and len(probe.calls) == 2
    grads = [p.grad for p in blocks.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    torch._dynamo.reset()


@pytest.mark.cpu
def test_capture_fails_loudly_if_spmd_types_moves_its_mesh_stack(monkeypatch):
    # A release that kept the mesh elsewhere would make the fix a silent no-op; it must raise.
    monkeypatch.setattr(spmd, "current_mesh", lambda: frozenset())
    with pytest.raises(RuntimeError, match="needs updating"):
        mesh_preserving_context_fn()


@pytest.mark.cpu
def test_policy_validation_names_the_allowed_values():
    with pytest.raises(ValueError, match="policy must be one of"):
        mesh_preserving_context_fn(policy=42)
    with pytest.raises(ValueError, match="context_fn must be a callable"):
        mesh_preserving(context_fn="selective")
    wrapped = mesh_preserving()
    assert mesh_preserving(wrapped) is wrapped  # idempotent


@pytest.mark.cpu
def test_wrapping_with_an_explicit_mesh_twice_wraps_once(mesh):
    # Review finding: with mesh=... every call added one more layer of wrapping.
    blocks, _, _ = _checkpoint_wrapped_model("selective")
    make_checkpoint_wrappers_mesh_preserving(blocks, mesh=mesh)
    first = [b.checkpoint_fn.keywords["context_fn"] for b in blocks]
    make_checkpoint_wrappers_mesh_preserving(blocks, mesh=mesh)
    again = [b.checkpoint_fn.keywords["context_fn"] for b in blocks]
    for fn_first, fn_again in zip(first, again, strict=True):
        # One mesh-preserving layer over the same original context_fn, not one over another.
        assert fn_again.__wrapped__ is fn_first.__wrapped__
        assert not getattr(fn_again.__wrapped__, "_stackfix_mesh_preserving", False)


def _checkpoint_wrapped_model(kind: str):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    blocks, x, probe = _blocks()
    for i, block in enumerate(blocks):
        if kind == "reentrant":
            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
        elif kind == "selective":
            wrapped = checkpoint_wrapper(block, context_fn=lambda: create_selective_checkpoint_contexts(
                torchtitan_style_policy()))
        else:
            wrapped = checkpoint_wrapper(block)
        blocks[i] = wrapped
    return blocks, x, probe


def _reference_grads(mesh, n=N_BLOCKS):
    blocks, x, _ = _blocks(n)
    with spmd.set_current_mesh(mesh):
        _loss(blocks, x).backward()
    return [p.grad for p in blocks.parameters()] + [x.grad]


def _forward_in_mesh_backward_on_worker(blocks, x, mesh):
    with spmd.set_current_mesh(mesh):
        loss = _loss(blocks, x)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(loss.backward).result()
    return [p.grad for p in blocks.parameters()] + [x.grad]


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["selective", "full"])
def test_make_checkpoint_wrappers_mesh_preserving(kind, mesh):
    blocks, x, probe = _checkpoint_wrapped_model(kind)
    assert make_checkpoint_wrappers_mesh_preserving(blocks) == N_BLOCKS
    first = [b.checkpoint_fn.keywords["context_fn"] for b in blocks]
    assert make_checkpoint_wrappers_mesh_preserving(blocks) == N_BLOCKS
    assert [b.checkpoint_fn.keywords["context_fn"] for b in blocks] == first  # idempotent
    grads = _forward_in_mesh_backward_on_worker(blocks, x, mesh)
    recompute = probe.calls[N_BLOCKS:]
    assert len(recompute) == N_BLOCKS and all(c["mesh"] == ["tp"] for c in recompute)
    assert all(torch.equal(a, b) for a, b in zip(grads, _reference_grads(mesh), strict=True))


@pytest.mark.cpu
def test_make_checkpoint_wrappers_rejects_reentrant():
    blocks, _, _ = _checkpoint_wrapped_model("reentrant")
    with pytest.raises(ValueError, match="non-reentrant"):
        make_checkpoint_wrappers_mesh_preserving(blocks)


def _torchtitan_spmd():
    return require("torchtitan.distributed.activation_checkpoint",
                   "torchtitan.distributed.spmd_types")


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["selective", "full"])
def test_torchtitan_ac_and_mesh_stack_on_another_thread(kind, mesh, monkeypatch):
    """torchtitan's own SelectiveAC / FullAC, then the helper; torchtitan's mesh stack and its
    dense-mesh registration are what recompute sees on the backward thread."""
    ac, titan_spmd = _torchtitan_spmd()
    # apply() also turns off dynamo's LRU cache process-wide (a compile workaround unrelated to
    # this test); keep it from leaking into other tests of this worker.
    monkeypatch.setattr(ac, "_disable_dynamo_lru_cache", lambda: None)
    config = ac.SelectiveAC.Config() if kind == "selective" else ac.FullAC.Config()
    torch.manual_seed(0)
    probe = Probe()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): TypedBlock(probe) for i in range(N_BLOCKS)})
    config.build(dump_folder="").apply(model)
    assert make_checkpoint_wrappers_mesh_preserving(model) == N_BLOCKS

    seen = []
    original = probe.record

    def record():
        seen.append((titan_spmd.current_spmd_mesh(), titan_spmd.spmd_dense_mesh(),
                     _mesh_names()))
        original()

    probe.record = record
    x = torch.randn(8, 16, requires_grad=True)
    titan_spmd.set_spmd_meshes(dense_mesh=mesh, sparse_mesh=None)
    try:
        with titan_spmd.set_current_spmd_mesh(mesh):
            loss = _loss(model.layers.values(), x)
    finally:  # the registration is this thread's; do not leave it to later tests
        for attr in ("dense_mesh", "sparse_mesh"):
            monkeypatch.delattr(titan_spmd._MESH_TLS, attr, raising=False)

    def backward_on_worker():
        loss.backward()
        return titan_spmd.current_spmd_mesh(), _mesh_names(), \
            getattr(titan_spmd._MESH_TLS, "dense_mesh", None)

    with ThreadPoolExecutor(1) as pool:
        after = pool.submit(backward_on_worker).result()
    recompute = seen[N_BLOCKS:]
    assert len(recompute) == N_BLOCKS
    assert all(c == (mesh, mesh, ["tp"]) for c in recompute), recompute
    assert after == (None, None, None)  # the worker's torchtitan + spmd_types state restored
    assert titan_spmd.current_spmd_mesh() is None


# --------------------------------------------------------------------------- single-threaded


def _enabled():
    return torch.autograd.is_multithreading_enabled()


@pytest.mark.cpu
def test_single_threaded_backward_sets_and_restores():
    assert _enabled()
    with single_threaded_backward():
        assert not _enabled()
        with ThreadPoolExecutor(1) as pool:  # thread-local: another thread is untouched
            assert pool.submit(_enabled).result()
    assert _enabled()
    with torch.autograd.set_multithreading_enabled(False):  # an outer "off" stays off
        with single_threaded_backward():
            assert not _enabled()
        assert not _enabled()
    assert _enabled()


@pytest.mark.cpu
def test_single_threaded_backward_restores_on_exception():
    with pytest.raises(KeyError):
        with single_threaded_backward():
            assert not _enabled()
            raise KeyError("step failed")
    assert _enabled()


@pytest.mark.cpu
def test_single_threaded_backward_degrades_on_old_torch(monkeypatch):
    monkeypatch.delattr(torch.autograd, "set_multithreading_enabled")
    ran = []
    with pytest.warns(SingleThreadedBackwardUnavailable, match="set_multithreading_enabled"):
        with single_threaded_backward():
            ran.append(True)
    assert ran == [True] and _enabled()


@pytest.mark.gpu
def test_single_threaded_backward_keeps_cuda_backward_on_the_calling_thread():
    threads = []
    x = torch.randn(4, 4, device="cuda", requires_grad=True)

    def run_backward():
        y = x.sin()
        y.register_hook(lambda g: threads.append(threading.get_ident()))
        y.sum().backward()

    run_backward()
    with single_threaded_backward():
        run_backward()
    with ThreadPoolExecutor(1) as pool:
        caller = pool.submit(threading.get_ident).result()
        with torch.autograd.set_multithreading_enabled(False):  # set on main only (verl #6950)
            pool.submit(run_backward).result()
    me = threading.get_ident()
    assert threads[0] != me  # default: autograd's CUDA device thread
    assert threads[1] == me  # single-threaded: the calling thread
    assert threads[2] != caller  # main's setting does not reach the pool thread


# --------------------------------------------------------------------------- robustness


@pytest.mark.cpu
def test_capture_fails_loudly_if_torchtitan_drops_its_mesh_thread_locals(monkeypatch, mesh):
    """A torchtitan whose spmd module has no ``_MESH_TLS`` would make recompute run without
    torchtitan's mesh (its collectives then skip silently): refused, naming the version."""
    import importlib.metadata
    import sys
    import types

    name = "torchtitan.distributed.spmd_types"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    with spmd.set_current_mesh(mesh):
        with pytest.raises(RuntimeError, match=rf"_MESH_TLS.*torchtitan {version}"):
            mesh_preserving_context_fn()


def _needs_mesh(t):
    if spmd.current_mesh() is None:
        raise RuntimeError("no current mesh")
    return t


def _inner(t):
    return _needs_mesh(t.sin()).cos()


def _outer(t, inner_context_fn):
    inner = checkpoint(_inner, t * 2, use_reentrant=False, context_fn=inner_context_fn)
    return _needs_mesh(inner).exp()


def _nested_loss(outer_context_fn, inner_context_fn, mesh, x):
    with spmd.set_current_mesh(mesh):
        return checkpoint(_outer, x, inner_context_fn, use_reentrant=False,
                          context_fn=outer_context_fn).sum()


@pytest.mark.cpu
def test_a_wrapped_outer_checkpoint_carries_the_mesh_into_unwrapped_inner_ones(mesh):
    from torch.utils.checkpoint import noop_context_fn

    x = torch.randn(4, requires_grad=True)
    _nested_loss(mesh_preserving_context_fn, noop_context_fn, mesh, x).backward()
    reference = x.detach().clone().requires_grad_()  # the same function, no checkpoint
    with spmd.set_current_mesh(mesh):
        _needs_mesh(_inner(reference * 2)).exp().sum().backward()
    assert torch.equal(x.grad, reference.grad)
    assert spmd.current_mesh() is None  # nothing left installed on this thread


@pytest.mark.cpu
def test_a_wrapped_inner_checkpoint_in_an_unwrapped_outer_one_is_refused(mesh):
    from torch.utils.checkpoint import noop_context_fn

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"nested in a checkpoint that is not mesh-preserving"):
        _nested_loss(noop_context_fn, mesh_preserving_context_fn, mesh, x)
    assert spmd.current_mesh() is None
