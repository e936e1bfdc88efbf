"""``fixes.recompute``: a region's recompute starts from the state its forward started from and
leaves the state as it found it -- for an attribute rebound by later layers (Megatron-LM #6793)
and a buffer updated in place (torchtitan #4568) -- through torch's context_fn and through a
wrapped function (megatron-core, reentrant); writes it manages are not side effects to the
recompute sanitizer. The repros (recompute-state-overwrite*, recompute-side-effect) check the
end-to-end gradients; this file the mechanism."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fixes.recompute import (
    RecomputeState,
    managed_storages,
    state_preserving,
    state_preserving_context_fn,
)
from fixes.sanitize import recompute_sanitizer

pytestmark = [pytest.mark.cpu, pytest.mark.no_stackfix_sanitize]


def _reader(holder, seen):
    def region(x):
        seen.append(holder.value)
        return (x * holder.value).sin()  # sin saves its input: the recompute runs to here
    return region


@pytest.mark.parametrize("how", ["context_fn", "function-non-reentrant", "function-reentrant"])
def test_recompute_sees_the_forwards_value_and_leaves_the_current_one(how):
    holder, seen = types.SimpleNamespace(value=2.0), []
    region = _reader(holder, seen)
    x = torch.ones(3, requires_grad=True)
    if how == "context_fn":
        y = checkpoint(region, x, use_reentrant=False,
                       context_fn=state_preserving_context_fn((holder, "value")))
    else:
        y = checkpoint(state_preserving(region, (holder, "value")), x,
                       use_reentrant=how == "function-reentrant")
    holder.value = 5.0  # a later layer's forward
    y.sum().backward()
    assert seen == [2.0, 2.0]  # forward, recompute
    assert holder.value == 5.0
    assert torch.equal(x.grad, 2.0 * torch.cos(torch.full((3,), 2.0)))


def test_a_buffer_updated_in_place_is_counted_once():
    counts = torch.zeros(2)
    owner = types.SimpleNamespace(counts=counts)

    def region(x):
        owner.counts.add_(1)
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    with recompute_sanitizer() as sanitizer:
        y = checkpoint(region, x, use_reentrant=False,
                       context_fn=state_preserving_context_fn((owner, "counts")))
        owner.counts.add_(10)  # updated after the region, before the backward
        y.sum().backward()  # the recompute's add_ is managed: not a side effect
    assert sanitizer.recomputes == 1
    assert owner.counts is counts and counts.tolist() == [11.0, 11.0]


def test_tensors_are_copied_back_only_when_mutated():
    """A rebound tensor attribute is put back by reference; its elements are not written (it
    may be saved for backward by another node, whose version check would then fail)."""
    first = torch.arange(3.0)
    holder = types.SimpleNamespace(t=first)
    state = RecomputeState((holder, "t"))
    with state.forward():
        pass
    holder.t = torch.zeros(3)
    version = first._version
    with state.recompute():
        assert holder.t is first
        assert managed_storages() >= {first.untyped_storage()._cdata}
    assert first._version == version and holder.t.tolist() == [0.0, 0.0, 0.0]
    assert managed_storages() == frozenset()


def test_a_missing_attribute_is_missing_in_the_recompute():
    holder = types.SimpleNamespace()
    state = RecomputeState((holder, "late"))
    with state.forward():
        pass
    holder.late = 1
    with state.recompute():
        assert not hasattr(holder, "late")
    assert holder.late == 1


def test_contracts_are_checked():
    with pytest.raises(TypeError, match=r"a target is \(object, 'attribute name'\)"):
        RecomputeState("holder.value")
    with pytest.raises(RuntimeError, match="before its forward"):
        with RecomputeState((types.SimpleNamespace(a=1), "a")).recompute():
            pass


def test_megatron_checkpoint_with_state_preserving():
    pytest.importorskip("megatron.core")
    from megatron.core import tensor_parallel

    from fixes.testing.megatron_cpu import install_megatron_cpu_rng_shim

    install_megatron_cpu_rng_shim()
    holder, seen = types.SimpleNamespace(value=3.0), []
    x = torch.ones(2, requires_grad=True)
    with recompute_sanitizer() as sanitizer:  # the fix's own copies are not region ops
        y = tensor_parallel.checkpoint(
            state_preserving(_reader(holder, seen), (holder, "value")), False, x)
        holder.value = 7.0
        y.sum().backward()
    assert seen == [3.0, 3.0] and holder.value == 7.0 and sanitizer.recomputes == 1
    assert torch.equal(x.grad, 3.0 * torch.cos(torch.full((2,), 3.0)))
