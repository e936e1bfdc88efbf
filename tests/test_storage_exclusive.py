"""``is_storage_exclusive``: generated alias graphs (Hypothesis) and hand-picked cases (views,
chunks, ``.data`` aliases, as_strided, saved tensors). Nothing here frees memory, so every check runs in-process and only reads counts."""

from __future__ import annotations

import os

import pytest
import torch
from alias_ops import VIEW_OPS, data_alias
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixes.megatron import is_storage_exclusive

pytestmark = pytest.mark.cpu

settings.register_profile(
    "stackfix-storage", max_examples=int(os.environ.get("STACKFIX_HYPOTHESIS_EXAMPLES", "500")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
)



alias_graphs = st.fixed_dictionaries({
    "chain": st.lists(st.sampled_from(sorted(VIEW_OPS)), min_size=1, max_size=6),
    "kept": st.lists(st.booleans(), min_size=6, max_size=6),
    "as_owner": st.lists(st.booleans(), min_size=6, max_size=6),
})


@settings(settings.get_profile("stackfix-storage"))
@given(alias_graphs)
def test_exclusive_iff_every_live_alias_is_an_owner(graph):
    base = torch.randn(4, 8)
    aliases, live, owners = [], [], []
    t = base
    for i, op in enumerate(graph["chain"]):
        t = VIEW_OPS[op](t)
        aliases.append(t)
        if graph["kept"][i]:
            live.append(t)
            if graph["as_owner"][i]:
                owners.append(t)
    del t
    # Dropped aliases die here, except those a kept view still holds as its _base: those are
    # live TensorImpls on the storage too, and only count as owned when named.
    aliases.clear()
    # Ground truth from the structure, not from counts: what the kept aliases keep alive.
    alive = {t._cdata for t in live + _bases(live)}
    foreign = alive - {base._cdata} - {o._cdata for o in owners}
    assert is_storage_exclusive(base, owners) is (not foreign)
    # A named owner's own holders never matter; the subject's do (see the saved tests below).
    assert is_storage_exclusive(base, live + _bases(live)) is True


def _bases(tensors):
    out, todo = [], list(tensors)
    while todo:
        b = todo.pop()._base
        if b is not None:
            out.append(b)
            todo.append(b)
    return out


@pytest.mark.parametrize("op", sorted(VIEW_OPS))
def test_each_alias_kind_counts_as_sharing(op):
    base = torch.randn(4, 8)
    alias = VIEW_OPS[op](base)
    assert is_storage_exclusive(base) is False
    assert is_storage_exclusive(base, owners=[alias]) is True
    del alias
    assert is_storage_exclusive(base) is True


def test_chunk_siblings_and_viewless_alias_of_a_chunk():
    h = torch.randn(4, 8)
    a, b = torch.chunk(h, 2, dim=-1)
    viewless = data_alias(a)
    del a
    assert not is_storage_exclusive(viewless)  # h and b still live
    assert not is_storage_exclusive(viewless, owners=[b])  # h still live
    assert is_storage_exclusive(viewless, owners=[b, h])


def test_tensorimpl_saved_by_autograd_is_not_exclusive_though_storage_count_is_one():
    # One TensorImpl saved by several nodes shows storage use count 1 (measured, torch 2.13).
    h = torch.randn(4, requires_grad=True) * 2
    storage = h.untyped_storage()
    assert torch._C._storage_Use_Count(storage._cdata) == 2  # h + our storage object
    del storage
    assert is_storage_exclusive(h)
    s1, s2 = h.sin(), h.cos()  # two nodes save the same TensorImpl
    assert not is_storage_exclusive(h)
    assert not is_storage_exclusive(h, saved_refs=1)
    assert is_storage_exclusive(h, saved_refs=2)
    del s1, s2
    assert is_storage_exclusive(h)


def test_leaf_held_by_its_accumulate_grad_node():
    w = torch.randn(4, requires_grad=True)
    y = w * 2  # the graph holds w through AccumulateGrad
    assert not is_storage_exclusive(w)
    del y
    assert is_storage_exclusive(w)


def test_bad_input_is_rejected():
    with pytest.raises(TypeError, match="torch.Tensor"):
        is_storage_exclusive([1, 2])
    with pytest.raises(TypeError, match="owners"):
        is_storage_exclusive(torch.ones(1), owners=[3])
    with pytest.raises(ValueError, match="saved_refs"):
        is_storage_exclusive(torch.ones(1), saved_refs=-1)


def test_uninspectable_tensors_are_never_exclusive():
    assert not is_storage_exclusive(torch.ones(2, 2).to_sparse())
