"""The rival fixes of the #3221 leak the benchmarks compare ours with (``repro.reclaims``):
Megatron-LM #6339 (``megatron-6339``: clear the detached inputs' ``.grad`` after backward) and
radixark/miles #2862 (``gc-collect``: ``gc.collect()`` after each recomputed backward). Each is
asserted on its mechanism, in-process, on PyTorch's reentrant checkpoint (whose backward calls
``ctx.run_function(*detached_inputs)`` as megatron-core's does): what it frees, what it leaves,
and that the gradients are the unwrapped backward's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint as tcp

from repro.harness.leaks import ModuleStateLeak, PythonCycle
from repro.reclaims import install_reclaim

pytestmark = pytest.mark.cpu
TARGET = tcp.CheckpointFunction


def _step(strategy: str, *, leak: ModuleStateLeak | None = None, cycle: list | None = None):
    """One checkpointed layer's forward and backward under ``strategy``; the detached input
    the recompute got (weakly) and the leaf's grad."""
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    leaf = torch.randn(4, 8, requires_grad=True)
    seen = []

    def body(x):
        out = (x @ w).tanh()
        if torch.is_grad_enabled():  # the recompute
            seen.append(weakref.ref(x))
            if leak is not None:
                leak.keep(out * 2)  # the #3221 shape: a kept intermediate whose graph ends at x
            if cycle is not None:
                PythonCycle(x)  # unreachable at once: only the cycle collector frees x
        return out

    install_reclaim(strategy, TARGET)
    try:
        TARGET.apply(body, True, leaf * 1.0).sum().backward()
    finally:
        install_reclaim("none", TARGET)
    return seen[0], leaf.grad


@pytest.fixture(autouse=True)
def _warm_and_no_collector():
    # the first checkpoint call imports torch._dynamo, whose frame pins its arguments until a
    # collection: warm up first, then keep the collector off so only the strategy collects
    _step("none")
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("strategy", ["none", "megatron-6339"])
def test_megatron_6339_drops_the_kept_inputs_grad_not_the_input(strategy):
    leak = ModuleStateLeak()
    detached, grad = _step(strategy, leak=leak)
    ref, ref_grad = _step("none")
    assert torch.equal(grad, ref_grad)
    assert detached() is not None  # the leaked graph keeps the input under both
    assert (detached().grad is None) == (strategy == "megatron-6339")
    leak.clear()


@pytest.mark.parametrize("strategy", ["none", "gc-collect"])
def test_gc_collect_frees_an_input_held_by_a_cycle_at_once(strategy):
    detached, grad = _step(strategy, cycle=[])
    _, ref_grad = _step("none")
    assert torch.equal(grad, ref_grad)
    assert (detached() is None) == (strategy == "gc-collect")
    gc.collect()
    assert detached() is None  # the cycle is garbage either way: only *when* it goes differs


def test_neither_rival_frees_an_input_a_kept_graph_holds():
    """The #3221 leak proper (a module keeps a recompute intermediate): reachable, so no
    collection frees the input, and #6339 frees only its grad."""
    for strategy in ("megatron-6339", "gc-collect"):
        leak = ModuleStateLeak()
        detached, _ = _step(strategy, leak=leak)
        assert detached() is not None, strategy
        leak.clear()
