"""Who holds a checkpoint input after the recompute (fixes.megatron.reclaim).

The recompute gets megatron's own detached copy of each input. Whatever holds that copy after
the backward besides its own AccumulateGrad node -- a module caching it, a tool keeping the
recompute's frames, a side result built during the recompute and backwarded later, a reference
cycle -- keeps it, readable and unchanged (event ``held``); otherwise it holds none of the
input's memory once the checkpoint's backward has returned (``released``: a leaked recompute
graph, Megatron-LM #3221 / #5227, keeps an empty copy). No storage is ever resized,
so no case here can read freed memory; the ones that did under earlier designs (SIGSEGV) still
run in a child interpreter, so a regression ends a child, not the test worker.
"""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
import torch.utils.checkpoint as tcp
from torch import nn

from fixes.megatron import (
    apply_recompute_reclaim_patch,
    recompute_reclaim_events,
    remove_recompute_reclaim_patch,
)
from repro import run_isolated
from repro.harness.leaks import ModuleStateLeak, PythonCycle

pytestmark = pytest.mark.cpu
TARGET = tcp.CheckpointFunction


class _Layer(nn.Module):
    def __init__(self, hook=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.hook = hook

    def forward(self, t):
        out = self.lin(t).tanh()
        if self.hook is not None:
            self.hook(t, out)
        return out


def _step(layer, retain_graph=False):
    """h -> checkpoint(layer) -> loss; returns (h.grad, lin.weight.grad, h's input storage ref)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    h = (x * 2).requires_grad_()  # a leaf: the checkpoint input
    inp = h * 1.0  # non-leaf input, exclusively the checkpoint's
    out = tcp.checkpoint(layer, inp, use_reentrant=True)
    weak = inp.untyped_storage()._weak_ref()
    del inp
    out.square().sum().backward(retain_graph=retain_graph)
    return h, out, weak


@pytest.fixture
def patched():
    apply_recompute_reclaim_patch(TARGET)
    yield
    remove_recompute_reclaim_patch(TARGET)


def test_a_module_caching_its_recompute_input_keeps_it_readable():
    # Review finding: the cache's tensor was released (reading it: SIGSEGV, exit 139) and its
    # grad dropped. Child interpreter: a regression must not take the test worker down.
    code = textwrap.dedent("""
        import torch, torch.utils.checkpoint as tcp
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from tests.test_reclaim_holders import _Layer, _step
        cache = []
        def remember(t, out):
            if torch.is_grad_enabled():
                cache.append(t)
        ref = _Layer(remember); _step(ref)
        expected, expected_grad = cache[0].clone(), cache[0].grad.clone()
        cache.clear()
        apply_recompute_reclaim_patch(tcp.CheckpointFunction)
        with recompute_reclaim_events() as events:
            _step(_Layer(remember))
        assert torch.equal(cache[0], expected) and torch.equal(cache[0].grad, expected_grad)
        print("EVENTS", [(e.role, e.action.value) for e in events])
    """)
    res = run_isolated(code=code, timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    assert "EVENTS [('input', 'held')]" in res.stdout, res.stdout


def test_a_tool_keeping_the_recompute_frames_alive_keeps_the_input_readable():
    """What compute-sanitizer's host backtraces do on CUDA (H200 finding): a tool records the
    calling Python frame of each call it tracks and keeps it, so the recompute's frames outlive
    it, their locals holding the checkpoint's detached input. Whoever holds a frame can read those
    locals: the input is kept, readable, until the tool lets go; the next step decides as usual."""
    code = textwrap.dedent("""
        import sys, torch, torch.utils.checkpoint as tcp
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from tests.test_reclaim_holders import _Layer, _step
        seen = []
        def ref_hook(t, out):
            if torch.is_grad_enabled():
                seen.append(t.detach().clone())
        _step(_Layer(ref_hook))
        expected = seen[0]
        frames = []
        def backtrace(frame, event, arg):  # the tool: the caller of every C call, kept
            if event == "c_call":
                frames.append(frame)
        apply_recompute_reclaim_patch(tcp.CheckpointFunction)
        layer = _Layer()
        sys.setprofile(backtrace)
        try:
            with recompute_reclaim_events() as events:
                _step(layer)
        finally:
            sys.setprofile(None)
        print("EVENTS", [(e.role, e.action.value) for e in events])
        held = [f.f_locals["t"] for f in frames
                if f.f_code is _Layer.forward.__code__ and torch.is_tensor(f.f_locals.get("t"))
                and f.f_locals["t"].requires_grad]
        assert held and all(torch.equal(t, expected) for t in held), len(held)
        del held
        frames.clear()
        with recompute_reclaim_events() as events:
            _step(layer)
        print("AFTER", [(e.role, e.action.value) for e in events])
    """)
    res = run_isolated(code=code, timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    assert "EVENTS [('input', 'held')]" in res.stdout, res.stdout
    # the tool let go: nothing holds the recompute's view any more
    assert "AFTER [('input', 'released')]" in res.stdout, res.stdout


def test_without_a_leak_nothing_is_resized_and_the_input_goes_at_once(patched, monkeypatch):
    def must_not_resize(*args, **kwargs):
        raise AssertionError("the reclaim must never resize a storage")

    remove_recompute_reclaim_patch(TARGET)
    h_ref, _, _ = _step(_Layer())
    apply_recompute_reclaim_patch(TARGET)
    monkeypatch.setattr(torch.UntypedStorage, "resize_", must_not_resize)
    with recompute_reclaim_events() as events:
        h, out, weak = _step(_Layer())
    assert [(e.role, e.action) for e in events] == [("input", "released")]
    assert torch.UntypedStorage._expired(weak)  # freed by reference counting
    assert torch.equal(h.grad, h_ref.grad)


def test_the_recompute_graph_leak_holds_none_of_the_input(patched, monkeypatch):
    # Megatron-LM #5227 shape: the module keeps a recompute intermediate, whose graph ends at the
    # copy's AccumulateGrad node. Nothing else holds the copy, so after the backward it lets go
    # of the input's memory and of its grad; no storage is resized.
    def must_not_resize(*args, **kwargs):
        raise AssertionError("the reclaim must never resize a storage")

    monkeypatch.setattr(torch.UntypedStorage, "resize_", must_not_resize)
    grads = []  # weak references to the storage of the gradient the copy's node accumulates

    def watch(t, out):
        leak.keep(out)
        if torch.is_grad_enabled():  # a tensor hook: it gets the gradient, not the copy
            t.register_hook(lambda g: grads.append(g.untyped_storage()._weak_ref()))

    remove_recompute_reclaim_patch(TARGET)
    leak = ModuleStateLeak()
    h_ref, _, weak = _step(_Layer(watch))
    assert not torch.UntypedStorage._expired(weak) and not torch.UntypedStorage._expired(grads[0])
    leak.clear()  # megatron's own backward: the leak holds both until the next step
    grads.clear()
    apply_recompute_reclaim_patch(TARGET)
    with recompute_reclaim_events() as events:
        h, _, weak = _step(_Layer(watch))
    assert [(e.role, e.action) for e in events] == [("input", "released")]
    assert len(leak.kept) == 1
    assert torch.UntypedStorage._expired(weak) and torch.UntypedStorage._expired(grads[0])
    assert torch.equal(h.grad, h_ref.grad)
    leak.clear()


def _side_result_code(chunked: bool) -> str:
    """The review's case 1: during the recompute the checkpointed function builds a side result
    from its input and keeps it; it is backwarded after the main backward. Before the rewrite:
    events ``input:released`` (``deferred`` / ``released-deferred`` for a chunk view), SIGSEGV."""
    return textwrap.dedent(f"""
        import torch, torch.utils.checkpoint as tcp
        from torch import nn
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from repro.harness.leaks import ModuleStateLeak

        def run(patched):
            torch.manual_seed(0)
            w = nn.Parameter(torch.randn(8))
            side, leak = [], ModuleStateLeak()
            def seg(x):
                out = (x * 2).tanh()
                if torch.is_grad_enabled():
                    side.append((x * w).sum())  # an auxiliary term, backwarded later
                    leak.keep(out)
                return out
            if patched:
                apply_recompute_reclaim_patch(tcp.CheckpointFunction)
            h = torch.randn(4, 16, requires_grad=True) * 1.0
            inp = torch.chunk(h, 2, -1)[1] if {chunked} else h[:, :8] * 1.0
            with recompute_reclaim_events() as events:
                out = tcp.checkpoint(seg, inp, use_reentrant=True)
                del inp, h
                out.sum().backward()
            side[-1].backward()  # reads the recompute's copy of the input
            return w.grad.clone(), [(e.role, e.action.value) for e in events]

        reference, _ = run(False)
        got, events = run(True)
        assert torch.equal(got, reference), (got, reference)
        print("EVENTS", events)
    """)


@pytest.mark.parametrize("chunked", [False, True], ids=["exclusive-input", "chunk-view-input"])
def test_a_side_result_of_the_recompute_backwarded_later_reads_its_input(chunked):
    res = run_isolated(code=_side_result_code(chunked), timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    # the side result's node saved the recompute's view of the input: it holds it, unchanged
    assert "EVENTS [('input', 'held')]" in res.stdout, res.stdout


def test_two_views_of_one_storage_in_one_checkpoint_are_both_let_go(patched):
    # Review finding (counting design): both were kept (each view's storage count saw the other)
    # and the leak stayed.
    leak = ModuleStateLeak()
    h = torch.randn(4, 16, requires_grad=True) * 1.0
    a, b = torch.chunk(h, 2, -1)
    weak = h.untyped_storage()._weak_ref()

    def layer(x, y):
        out = (x * y).tanh()
        leak.keep(out)
        return out

    out = tcp.checkpoint(layer, a, b, use_reentrant=True)
    del h, a, b
    with recompute_reclaim_events() as events:
        out.sum().backward()
    assert [e.action for e in events if e.role == "input"] == ["released", "released"]
    assert torch.UntypedStorage._expired(weak)
    leak.clear()


def test_a_reference_cycle_holding_the_input_is_a_holder_and_goes_with_the_collector(patched):
    # A cycle is a Python holder like any other: kept, and freed when the cycle collector runs
    # (also one promoted to the oldest generation: the reclaim runs no collection of its own).
    gc.collect()
    gc.disable()
    try:
        with recompute_reclaim_events() as events:
            _, _, weak = _step(_Layer(lambda t, out: PythonCycle(t) if torch.is_grad_enabled()
                                      else None))
        assert [(e.role, e.action) for e in events] == [("input", "held")]
        assert not torch.UntypedStorage._expired(weak)
        gc.collect()
        assert torch.UntypedStorage._expired(weak)
    finally:
        gc.enable()


def test_the_reclaim_runs_no_garbage_collection(patched):
    """A full collection scans every object of the process (170 ms per backward pass measured
    with torch imported); the reclaim needs none."""
    cache = []
    generations = []

    def on_gc(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.collect()
    gc.disable()
    gc.callbacks.append(on_gc)
    try:
        with recompute_reclaim_events() as events:
            _step(_Layer(lambda t, out: cache.append(t) if torch.is_grad_enabled() else None))
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
    assert [(e.role, e.action) for e in events] == [("input", "held")]
    assert generations == []


class _RecomputesTwice(torch.autograd.Function):
    """A reentrant checkpoint whose backward runs the recompute twice and returns the second
    call's gradient: the reclaim relies on no shape of the backward, it examines every copy."""

    @staticmethod
    def forward(ctx, run_function, recompute, x):
        ctx.run_function, ctx.recompute = run_function, recompute
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if not ctx.recompute:  # a backward that never recomputes
            return None, None, grad * 2.0
        for _ in range(2):
            copy = x.detach().requires_grad_()
            with torch.enable_grad():
                out = ctx.run_function(copy)
        torch.autograd.backward(out, grad)
        return None, None, copy.grad


@pytest.mark.parametrize("recomputes", [True, False], ids=["twice", "never"])
def test_a_backward_of_another_shape_returns_its_own_result(recomputes):
    leak = ModuleStateLeak()
    apply_recompute_reclaim_patch(_RecomputesTwice)
    try:
        x = torch.randn(3, requires_grad=True)
        with recompute_reclaim_events() as events:
            fn = lambda t: leak.keep(t * 2.0) or t * 2.0  # noqa: E731
            _RecomputesTwice.apply(fn, recomputes, x).sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0))
        assert [(e.role, e.action) for e in events] == (
            [("input", "released")] * 2 if recomputes else [("checkpoint", "unobserved")])
    finally:
        remove_recompute_reclaim_patch(_RecomputesTwice)
        leak.clear()


def test_retain_graph_a_second_backward_recomputes_from_the_untouched_input():
    # Review finding (old design): the second backward raised "data is not allocated yet" (or
    # read freed memory). Child interpreter, as above.
    code = textwrap.dedent("""
        import torch, torch.utils.checkpoint as tcp
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from repro.harness.leaks import ModuleStateLeak
        from tests.test_reclaim_holders import _Layer, _step
        from repro.harness.leaks import storage_gone
        leak = ModuleStateLeak()
        layer = lambda: _Layer(lambda t, out: leak.keep(out))
        h_ref, out_ref, _ = _step(layer(), retain_graph=True)
        out_ref.square().sum().backward()
        leak.clear()
        apply_recompute_reclaim_patch(tcp.CheckpointFunction)
        with recompute_reclaim_events() as events:
            h, out, weak = _step(layer(), retain_graph=True)
            out.square().sum().backward()
        assert torch.equal(h.grad, h_ref.grad)
        del out
        leak.clear()
        assert storage_gone(weak)
        print("EVENTS", [e.action.value for e in events])
    """)
    res = run_isolated(code=code, timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    # each backward recomputes with a copy of its own: released each time
    assert "EVENTS ['released', 'released']" in res.stdout, res.stdout
