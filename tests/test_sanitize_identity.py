"""A region's identity (``fixes.sanitize._ran.identity``) where its function's closure holds a
container made anew for each call: megatron-core 0.19's selective attention recompute
(``Attention._checkpointed_attention_forward``) closes over ``core_attention_extra_kwargs``
(a new ``{}`` when none are given) and ``tensor_kwarg_names`` (a new ``[]``). Told apart by
object, every call was a new identity: in ``sampled`` and ``none`` each attention region
recorded the modules its forward ran, found what its function reaches again and narrowed it,
and kept its mask type's bits (a new one-element tensor each call), where a region of a
known identity reads all three from its identity's last one -- on the H100 with megatron-core
0.19.2 the MoE-layer cell's ``none`` spent ~40 us a region finding and ~45 us snapshotting
that megatron-core 0.16.1 (the CPU envs') did not."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fixes.sanitize import RecomputeMismatchError, _reach, recompute_sanitizer
from fixes.sanitize._ran import identity

pytestmark = [pytest.mark.cpu, pytest.mark.no_stackfix_sanitize]


def _closure(extra, names, bias=None):
    """A new closure of one code over ``extra``, ``names`` and ``bias`` (as megatron's
    ``custom_forward``)."""

    def custom_forward(*inputs):
        return inputs, extra, names, bias

    return custom_forward


@pytest.mark.parametrize("extra, names", [
    ({}, []),
    ({"window": 128, "causal": True}, ["x", "qr"]),
    ({"spec": (1, 2.5, None)}, [("a", b"b")]),
], ids=["empty", "plain values", "nested plain values"])
def test_a_fresh_container_of_plain_values_is_told_by_its_value(extra, names):
    """Two calls' closures, each over its own copy of the same containers: one identity."""
    import copy

    first = identity(_closure(copy.deepcopy(extra), copy.deepcopy(names)))
    again = identity(_closure(copy.deepcopy(extra), copy.deepcopy(names)))
    assert first == again


@pytest.mark.parametrize("one, other", [
    ({"window": 128}, {"window": 64}), ({"a": 1}, {"b": 1}), ({1: 2}, {1.0: 2}),
    ({1: 2}, {True: 2}), ({}, []), ([], ()), ([1], [1.0]), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
], ids=["other value", "other key", "int or float key", "int or bool key", "dict or list",
        "list or tuple", "int or float item", "other order"])
def test_other_contents_or_container_types_are_another_identity(one, other):
    """Equal by ``==`` is not enough: 1, 1.0 and True, a list and a tuple, and a dict's order
    are told apart (a function can tell them apart too)."""
    assert identity(_closure(one, [])) != identity(_closure(other, []))


@pytest.mark.parametrize("held", ["a tensor", "a module", "a function", "a set",
                                  "a subclass of dict", "nine items", "too deep"])
def test_a_container_holding_anything_else_is_told_by_object(held):
    """A tensor, module or callable can change what the function reaches or does while the
    container stays equal by value; past ``_FROZEN_ITEMS`` items or two levels the contents
    are not read: each call's container is then its own identity, as before."""

    class _Dict(dict):
        pass

    def value():
        return {"a tensor": lambda: {"t": torch.zeros(1)},
                "a module": lambda: {"m": torch.nn.Identity()},
                "a function": lambda: {"f": len},
                "a set": lambda: {"s": {1}},
                "a subclass of dict": lambda: _Dict(a=1),
                "nine items": lambda: list(range(9)),
                "too deep": lambda: [[[1]]]}[held]()

    assert identity(_closure(value(), [])) != identity(_closure(value(), []))


class _Attention(torch.nn.Module):
    """megatron-core 0.19's ``_checkpointed_attention_forward`` in small: each call makes a new
    ``{}``, ``[]`` and one-element mask-type tensor and checkpoints a new closure over them
    and the module; ``extra`` given, its tensors are the closure's (``scale``: a buffer the
    function writes when ``counting`` -- a write outside the region on its recompute; no
    attribute of the module, so the closure alone reaches it)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.counting = False

    def forward(self, h, reentrant: bool, extra=None):
        extra = {} if extra is None else extra
        names = []
        mask_type = torch.tensor([1], dtype=torch.int)
        module = self

        def custom_forward(h, mask_type):
            if module.counting and "scale" in extra and not names:
                extra["scale"].add_(1)
            return torch.tanh(module.proj(h)) * mask_type.item()

        return checkpoint(custom_forward, h, mask_type, use_reentrant=reentrant)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("values", ["sampled", "none"])
def test_megatron_0_19s_attention_closure_keeps_its_identity_across_steps(
        monkeypatch, values, reentrant):
    """From the second step on a region reads its identity's last record, plan and argument
    slots: no module recorded, nothing found again through the closure (``narrowed``), and
    the mask type (made anew each call) compared by counter, not snapshotted by its bits."""
    layers = torch.nn.ModuleList(_Attention() for _ in range(2))
    narrowed, small = [], []
    real_narrowed, real_init = _reach.narrowed, _reach.State.__init__
    monkeypatch.setattr(_reach, "narrowed", lambda *a: narrowed.append(1) or real_narrowed(*a))

    def init(state, found):
        real_init(state, found)
        small.append(len(state.small))

    monkeypatch.setattr(_reach.State, "__init__", init)
    steps = []
    with recompute_sanitizer(values=values) as sanitizer:
        for _ in range(4):
            before = (sanitizer._walks.recorded, len(narrowed), len(small))
            h = torch.randn(4, 8, requires_grad=True)
            for layer in layers:
                h = layer(h, reentrant)
            h.sum().backward()
            steps.append((sanitizer._walks.recorded - before[0], len(narrowed) - before[1],
                          sum(small[before[2]:])))
    # (modules recorded, closures narrowed, small tensors snapshotted) per step
    assert steps[0] == (2, 2, 4)  # each region's mask type and input
    assert steps[1:] == [(0, 0, 0)] * 3


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_a_tensor_put_into_the_closures_container_is_still_reached(values):
    """The container told by value while it holds plain values: the step it holds a tensor
    the recompute writes (a write outside the region), its identity is another and what the
    function reaches is found again -- the write caught in that step (``all``: its line named in the
    next), in every mode."""
    layer = _Attention()
    layer.counting = True
    with recompute_sanitizer(values=values):
        for _ in range(3):
            layer(torch.randn(4, 8, requires_grad=True), False).sum().backward()
        scale = torch.ones(())
        with pytest.raises(RecomputeMismatchError, match="custom_forward"):
            for _ in range(2):  # ``all`` names the line on the region's next recompute
                layer(torch.randn(4, 8, requires_grad=True), False,
                      {"scale": scale}).sum().backward()


def _holder(kind: str, lin: torch.nn.Module):
    """A region function holding a small container of plain values (the identity reads it by
    value) and a way to put a tensor into it after the checkpoint call: the function writes
    that tensor (its recompute writes it again: a write outside the region)."""
    if kind == "list in a cell":
        stash = []

        def f(h):
            if stash:
                stash[0].add_(1)
            return torch.tanh(lin(h))

        return f, stash.append
    if kind == "dict in a cell":
        extra = {"window": 4}

        def f(h):
            if "scale" in extra:
                extra["scale"].add_(1)
            return torch.tanh(lin(h)) * extra["window"]

        return f, lambda t: extra.__setitem__("scale", t)
    if kind == "list in a tuple":
        inner = [1]
        box = (inner, "x")

        def f(h):
            if isinstance(box[0][-1], torch.Tensor):
                box[0][-1].add_(1)
            return torch.tanh(lin(h))

        return f, inner.append
    if kind == "default argument":
        stash = []

        def f(h, stash=stash):
            if stash:
                stash[0].add_(1)
            return torch.tanh(lin(h))

        return f, stash.append
    held = None  # "a cell rebound" (nonlocal), beside a dict the identity reads by value
    extra = {}

    def f(h):
        extra.get("x")
        if held is not None:
            held.add_(1)
        return torch.tanh(lin(h))

    def rebind(t):
        nonlocal held
        held = t

    return f, rebind


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("values", ["all", "sampled", "none"])
@pytest.mark.parametrize("kind", ["list in a cell", "dict in a cell", "list in a tuple",
                                  "default argument", "a cell rebound"])
def test_a_tensor_the_function_comes_to_hold_after_its_call_is_still_reached(
        kind, values, reentrant):
    """The identity is read at the checkpoint call; what the function reaches is found at its
    recompute. Where the function's closure changed in between -- a tensor put into a
    container the identity read by value, a cell rebound -- the region is not its call's
    identity at the recompute: what it reaches is found again, not taken from the identity's
    plan (a review of 912530d: the plan, made while the container held plain values, missed
    the tensor put in later, in every mode, where 912530d^ found it again each recompute)."""
    lin = torch.nn.Linear(8, 8)
    counter = torch.zeros(())
    with pytest.raises(RecomputeMismatchError), recompute_sanitizer(values=values):
        for step in range(6):
            f, put = _holder(kind, lin)
            y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=reentrant)
            if step >= 2:
                put(counter)  # after the call, before the backward's recompute
            y.sum().backward()
