"""What the reclaim may free: only memory nothing live can read (fixes.megatron.reclaim).

A holder of the checkpoint's detached input that is reachable (a module caching its recompute
input) is a reader; the recompute graph keeping it (the Megatron-LM #3221 / #5227 leak) is not;
an unreachable reference cycle is collected. A second backward (``retain_graph=True``) needs
the inputs. Crashing cases run in a child interpreter: a wrong answer there is a SIGSEGV.
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


def _released(weak) -> bool:
    if torch.UntypedStorage._expired(weak):
        return True
    return torch.UntypedStorage._new_with_weak_ptr(weak).nbytes() == 0


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
        print("EVENTS", [(e.role, e.action) for e in events])
    """)
    res = run_isolated(code=code, timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    assert "EVENTS [('input', 'deferred'), ('input', 'kept')]" in res.stdout, res.stdout


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
        print("EVENTS", [(e.role, e.action) for e in events])
        held = [f.f_locals["t"] for f in frames
                if f.f_code is _Layer.forward.__code__ and torch.is_tensor(f.f_locals.get("t"))
                and f.f_locals["t"].requires_grad]
        assert held and all(torch.equal(t, expected) for t in held), len(held)
        del held
        frames.clear()
        with recompute_reclaim_events() as events:
            _step(layer)
        print("AFTER", [(e.role, e.action) for e in events])
    """)
    res = run_isolated(code=code, timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    assert "EVENTS [('input', 'deferred'), ('input', 'kept')]" in res.stdout, res.stdout
    # the tool let go: nothing holds the copy any more, so no leak either: reference counting
    assert "AFTER [('input', 'refcounted')]" in res.stdout, res.stdout


def test_without_a_leak_nothing_is_inspected_or_resized(patched, monkeypatch):
    # A launch-bound H200 step (H=1024 GPT+MTP bf16, 26 ms) paid ~0.1 ms per checkpoint for the
    # full decision, on checkpoints whose memory reference counting frees at the same moment.
    from fixes.megatron import reclaim

    def must_not_run(*args, **kwargs):
        raise AssertionError("a leak-free checkpoint must not be inspected or resized")

    remove_recompute_reclaim_patch(TARGET)
    h_ref, _, _ = _step(_Layer())
    apply_recompute_reclaim_patch(TARGET)
    for name in ("_reclaim", "_graph_retained", "exclusive_unchecked", "release_storage"):
        monkeypatch.setattr(reclaim, name, must_not_run)
    with recompute_reclaim_events() as events:
        h, out, weak = _step(_Layer())
    assert [(e.role, e.action) for e in events] == [("input", "refcounted")]
    assert torch.UntypedStorage._expired(weak)  # freed by reference counting, not resized
    assert torch.equal(h.grad, h_ref.grad)


def test_the_recompute_graph_leak_is_released_at_once(patched):
    # Megatron-LM #5227 shape: the module keeps a recompute intermediate; its graph holds the
    # detached input and its grad. Nothing can read them: released / dropped right away.
    leak = ModuleStateLeak()
    with recompute_reclaim_events() as events:
        _, _, weak = _step(_Layer(lambda t, out: leak.keep(out)))
    assert [(e.role, e.action) for e in events] == [("input", "released"), ("grad", "dropped")]
    assert _released(weak) and len(leak.kept) == 1
    leak.clear()


def test_an_unreachable_cycle_holding_the_input_is_collected_at_the_end_of_backward(patched):
    gc.disable()
    try:
        with recompute_reclaim_events() as events:
            _, _, weak = _step(_Layer(lambda t, out: PythonCycle(t) if torch.is_grad_enabled()
                                      else None))
        assert [(e.role, e.action) for e in events] == [("input", "deferred"), ("input", "gone")]
        assert torch.UntypedStorage._expired(weak)  # the collector freed it, nothing resized
    finally:
        gc.enable()


def test_a_live_holder_costs_no_full_collection(patched):
    """Telling a live holder from an unreachable cycle must not cost a full collection on every
    backward pass: that scans every object of the process (170 ms per pass measured with torch
    imported, against 1 ms for six tiny checkpoints without the reclaim). The cycles a step makes
    are young; the young generations are enough."""
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
    assert [(e.role, e.action) for e in events] == [("input", "deferred"), ("input", "kept")]
    assert generations and max(generations) < 2, generations


def test_retain_graph_leaves_inputs_for_the_second_backward():
    # Review finding: the second backward raised "data is not allocated yet" (or read freed
    # memory). Child interpreter, as above.
    code = textwrap.dedent("""
        import torch, torch.utils.checkpoint as tcp
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from repro.harness.leaks import ModuleStateLeak
        from tests.test_reclaim_holders import _Layer, _released, _step
        # a leaking layer: the copy stays held, so the full decision and its retain_graph check
        # run (a checkpoint nothing leaked is left to reference counting before either)
        leak = ModuleStateLeak()
        layer = lambda: _Layer(lambda t, out: leak.keep(out))
        h_ref, out_ref, _ = _step(layer(), retain_graph=True)
        out_ref.square().sum().backward()
        leak.clear()
        apply_recompute_reclaim_patch(tcp.CheckpointFunction)
        with recompute_reclaim_events() as events:
            h, out, weak = _step(layer(), retain_graph=True)
            leak.clear()  # the first recompute's copy would share the input's storage: kept
            out.square().sum().backward()
        assert torch.equal(h.grad, h_ref.grad) and _released(weak)
        print("EVENTS", [e.action for e in events])
    """)
    res = run_isolated(code=code, timeout=120, forkserver=True)
    assert res.ok, res.describe() + "\n" + res.stderr[-3000:]
    assert "EVENTS ['retained', 'released', 'dropped']" in res.stdout, res.stdout
