"""What stays compared by its bits when a module's rebound values are compared by counter
(``fixes.sanitize._reach``: ``_Kept.rebound``, ``_by_counter``). Written by a review of the
first version (every non-buffer tensor of a module scanned again went to the counter); each
test failed on it and passes on the one that sends only rebound values there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fixes.sanitize import RecomputeMismatchError, _reach, recompute_sanitizer

pytestmark = [pytest.mark.cpu, pytest.mark.no_stackfix_sanitize]


def _changed_ids(walks, roots, write):
    found = walks.reach(roots, fresh=False)
    state = _reach.State(found)
    write()
    state.settle()
    return {id(t) for t, _ in state.changed()}


class _Holder(torch.nn.Module):
    """A module holding its child batch norm's running mean as a plain attribute too (tied),
    and a routing tensor it rebinds; the child rebinds a plain attribute of its own."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(3)
        self.alias = self.bn.running_mean  # another module's registered buffers
        self.alias_var = self.bn.running_var
        self.route = torch.zeros(2)
        self.bn.last = torch.zeros(2)


def _rebound_once(model: torch.nn.Module) -> _reach.Reached:
    """What a kept walk of ``model`` reads after ``model.route`` was rebound once (one
    rescan)."""
    model.route = torch.zeros(2)
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        model.route = torch.ones(2)
        found = walks.reach([model], fresh=False)
    assert walks.rescanned == 1
    return found


def test_another_modules_buffer_tied_into_a_volatile_entry_keeps_bits():
    """Both entries volatile, the holder (entry 0) read first: the child's registered buffer
    is classified by the holder's ``_buffers`` (not it) and goes to the counter; batch norm's
    running-stat update bumps no counter, so the recompute's write is lost."""
    model = _Holder()
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        model.route = torch.ones(2)  # both entries scanned again (volatile)
        model.bn.last = torch.ones(2)
        x = torch.randn(4, 3)
        version = model.bn.running_mean._version
        changed = _changed_ids(walks, [model], lambda: model.bn(x))  # training mode
    assert walks.rescanned == 2
    assert model.bn.running_mean._version == version  # the write bypassed the counter
    assert id(model.bn.running_mean) in changed


class _PlainStats(torch.nn.Module):
    """Running statistics kept as plain attributes (not registered), updated by torch's own
    batch_norm -- no counter bump; a routing tensor rebound every forward."""

    def __init__(self):
        super().__init__()
        self.mean, self.var = torch.zeros(3), torch.ones(3)
        self.route = torch.zeros(2)

    def forward(self, x):
        self.route = x.detach().argmax(-1)
        return F.batch_norm(x, self.mean, self.var, training=True)


def test_functional_batch_norm_into_a_plain_attribute_of_a_volatile_module():
    """Not ``.data``: a plain torch op (F.batch_norm) writing a non-buffer tensor of a module
    that rebinds an attribute. The README names only ``.data`` as given up."""
    model = _PlainStats()
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        model.route = torch.ones(2)
        x = torch.randn(4, 3)
        changed = _changed_ids(walks, [model], lambda: model(x))
    assert walks.rescanned == 1
    assert id(model.mean) in changed


def test_a_small_inference_tensor_on_a_volatile_module_is_still_read():
    """A small tensor made under ``torch.inference_mode`` (a cache built during evaluation)
    on a module that rebinds an attribute keeps its bits compared: an inference tensor has no
    counter (sent to it, ``State`` raised and the sanitizer left the region unchecked)."""
    model = torch.nn.Linear(2, 2)
    with torch.inference_mode():
        model.cache = torch.zeros(4)
    _reach.State(_rebound_once(model)).settle()  # no exception


def test_odd_tensors_on_a_volatile_module_do_not_crash():
    """None buffer, meta, sparse and a non-contiguous small tensor on a volatile entry."""
    model = torch.nn.Linear(2, 2)
    model.register_buffer("empty", None)
    model.register_buffer("running", torch.zeros(3))
    model.meta = torch.empty(3, device="meta")
    model.sparse = torch.eye(3).to_sparse()
    model.strided = torch.zeros(3, 4).t()
    found = _rebound_once(model)
    state = _reach.State(found)
    model.strided.add_(1)
    state.settle()
    assert any(t is model.strided for t, _ in state.changed())


class _Idempotent(torch.nn.Module):
    """A routing tensor rebound every forward beside a persistent plain tensor the forward
    rewrites with the same values each time (an in-place reset)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.route = torch.zeros(2)
        self.mask = torch.ones(4)

    def forward(self, x):
        self.route = x.detach().argmax(-1)
        self.mask.fill_(1.0)  # same bits every time
        return self.lin(x) * self.mask


def test_a_same_value_in_place_write_on_a_volatile_module_is_no_alarm():
    """values='none': step 1 walks fresh (bits), from step 2 the module is volatile. A
    recompute rewriting the same bits was no change by bits; by counter it is a write."""
    model = _Idempotent()
    with recompute_sanitizer(values="none") as sanitizer:
        for _ in range(4):
            checkpoint(model, torch.randn(3, 4, requires_grad=True),
                       use_reentrant=False).sum().backward()
    assert sanitizer.recomputes == 4 and sanitizer.detections == 0


class _HolderForward(_Holder):
    def forward(self, x):
        self.route = x.detach().sum(0)[:2]
        self.bn.last = x.detach()[0, :2]
        if not getattr(self, "update", False):  # the first steps (a fresh walk: bits) clean
            return x * self.bn.weight  # saves x: a recompute, nothing written
        # torch's batch norm on the child's registered statistics (no counter bump; the
        # child's num_batches_tracked is left alone so it does not give the write away)
        return F.batch_norm(x, self.bn.running_mean, self.bn.running_var, training=True)


def test_end_to_end_tied_buffer_write_is_caught():
    """The first test through the sanitizer (values='none'): the recompute's second
    running-stat update of a registered buffer is a write outside the region."""
    model = _HolderForward()
    with pytest.raises(RecomputeMismatchError):
        with recompute_sanitizer(values="none"):
            for step in range(5):
                model.update = step > 2
                checkpoint(model, torch.randn(4, 3, requires_grad=True),
                           use_reentrant=False).sum().backward()


def test_a_region_argument_a_volatile_module_also_holds_keeps_bits():
    """The commit's test says a small tensor the region is given as an argument keeps its bits
    compared; not where a volatile module also holds it (``apart`` keeps it out of ``own``)."""
    model = torch.nn.Linear(2, 2)
    arg = torch.ones(3)
    model.last_input = arg
    model.route = torch.zeros(2)
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        model.route = torch.ones(2)
        found = walks.reach([model, arg], fresh=False)
    assert walks.rescanned == 1
    assert id(arg) in {id(t) for t in found.small}


def test_arguments_made_anew_for_each_region_go_to_the_counter_those_passed_again_keep_bits():
    """A region's small tensor arguments (``Walks._rebound_arguments``): megatron passes its
    attention's mask type as a new one-element tensor each call -- compared by counter from
    its identity's second region on; a tensor passed again (a buffer handed to the function)
    and every argument of the identity's first region keep their bits compared."""
    walks = _reach.Walks()
    buffer = torch.zeros(3)

    def region(x, mask_type, stats):
        return x

    def reach(fresh):
        found = walks.reach([region, fresh, buffer], fresh=False, key=("site", 0, "identity"))
        return {id(t) for t in found.small}, {id(t) for t in found.versioned}

    first = torch.tensor([1], dtype=torch.int32)
    small, versioned = reach(first)
    assert {id(first), id(buffer)} <= small and not versioned & {id(first), id(buffer)}
    del first  # the last step's, freed (its id may be the next one's)
    for _ in range(3):
        fresh = torch.tensor([1], dtype=torch.int32)
        small, versioned = reach(fresh)
        assert id(fresh) in versioned and id(fresh) not in small
        assert id(buffer) in small and id(buffer) not in versioned
    other = walks.reach([region, torch.ones(1), buffer], fresh=False, key=("site", 1, "id"))
    assert {id(t) for t in other.small} >= {id(buffer)} and len(other.small) == 2  # its first


def test_functional_batch_norm_into_buffers_passed_as_arguments_is_caught_every_step():
    """Running statistics handed to the region as its arguments, the same tensors each step,
    updated by torch's own batch_norm (no counter bump): the recompute's second update is a
    write outside the region, found in every step -- not only in the identity's first."""
    mean, var = torch.zeros(3), torch.ones(3)
    weight = torch.nn.Parameter(torch.ones(3))

    def region(x, running_mean, running_var):
        return F.batch_norm(x, running_mean, running_var, weight, training=True)

    caught = 0
    with recompute_sanitizer(values="none"):
        for _ in range(4):
            x = torch.randn(4, 3, requires_grad=True)
            try:
                checkpoint(region, x, mean, var, use_reentrant=False).sum().backward()
            except RecomputeMismatchError as exc:
                assert "outside the region" in str(exc)
                caught += 1
    assert caught == 4


def _batch_norm_region(x, running_mean, running_var):
    weight = torch.ones(3)
    return F.batch_norm(x, running_mean, running_var, weight, training=True)


def _caught_each_step(arguments, steps: int = 4) -> int:
    """Steps (of ``steps``) whose backward raised: functional batch norm into the running
    statistics ``arguments(step)`` gives the region, under ``values="none"``."""
    caught = 0
    with recompute_sanitizer(values="none"):
        for step in range(steps):
            x = torch.randn(4, 3, requires_grad=True)
            try:
                checkpoint(_batch_norm_region, x, *arguments(step),
                           use_reentrant=False).sum().backward()
            except RecomputeMismatchError:
                caught += 1
    return caught


@pytest.mark.parametrize("made", ["row", "slice", "detach"])
def test_persistent_statistics_passed_as_a_new_view_each_call_are_caught_every_step(made):
    """A review of the first version, which told a new argument by its tensor object: stacked
    per-layer statistics passed as ``stats[i]`` (or ``stats[i, :]``, or ``.detach()``) are a
    new tensor each call over the same storage; sent to the counter from the second step, the
    recompute's second update went unseen (caught 1 of 4)."""
    mean, var = torch.zeros(2, 3), torch.ones(2, 3)
    view = {"row": lambda t: t[0], "slice": lambda t: t[0, :],
            "detach": lambda t: t[0].detach()}[made]
    assert _caught_each_step(lambda step: (view(mean), view(var))) == 4


def test_other_persistent_statistics_at_the_same_slot_each_step_are_caught_every_step():
    """The same review: one call site whose layers alternate from step to step passes another
    layer's buffers at the same round position (the same identity) -- each still alive, so
    none is taken for an argument made anew (caught 1 of 6 by the first version)."""
    means, variances = [torch.zeros(3), torch.zeros(3)], [torch.ones(3), torch.ones(3)]
    assert _caught_each_step(lambda step: (means[step % 2], variances[step % 2]), 6) == 6


def test_without_one_python_object_per_storage_every_argument_keeps_its_bits(monkeypatch):
    monkeypatch.setattr(_reach, "_STORAGE_KEPT", False)
    walks = _reach.Walks()

    def region(x, mask_type):
        return x

    for _ in range(3):
        fresh = torch.tensor([1], dtype=torch.int32)
        found = walks.reach([region, fresh], fresh=False, key=("site", 0, "identity"))
        assert any(t is fresh for t in found.small)
    assert _reach._storage_kept()  # this torch keeps them (the GPU image's too, by its tests)
