"""What a checkpointed region reaches outside itself (``fixes.sanitize._reach``): the walk, its
kept copy between fresh walks, and the small state snapshot taken in one buffer per device."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fixes.sanitize import _reach

pytestmark = pytest.mark.cpu


class _Config:
    def __init__(self):
        self.table = torch.zeros(4)  # a tensor behind a plain object every module holds
        for i in range(200):
            setattr(self, f"field_{i}", i)


def _model(config, n=3):
    layers = torch.nn.ModuleList()
    for _ in range(n):
        layer = torch.nn.Linear(4, 4)
        layer.config = config
        layer.register_buffer("running", torch.zeros(4))
        layers.append(layer)
    return layers


def test_the_walk_finds_parameters_buffers_and_attributes_each_once():
    config = _Config()
    model = _model(config)
    arg = torch.ones(2)
    found = _reach.reached([model.forward, arg])
    ids = {id(t) for t in found}
    assert len(ids) == len(found)
    expected = [arg, config.table, *model.parameters(), *model.buffers()]
    assert {id(t) for t in expected} <= ids


def test_kept_walks_reuse_the_last_walk_until_a_fresh_one():
    model = _model(_Config())
    walks = _reach.Walks()
    first = walks.reached([model], fresh=True)
    model[0].late = torch.ones(3)  # attached after the walk
    kept = walks.reached([model], fresh=False)
    assert {id(t) for t in kept} == {id(t) for t in first}
    walks.new_round()
    fresh = walks.reached([model], fresh=True)
    assert id(model[0].late) in {id(t) for t in fresh}
    # arguments are new every call: never taken from the kept walk
    arg = torch.ones(2)
    assert id(arg) in {id(t) for t in walks.reached([model, arg], fresh=False)}


def test_a_kept_walk_is_not_reused_for_another_module_at_a_reused_id():
    walks = _reach.Walks()
    model = _model(_Config(), n=1)
    walks.reached([model], fresh=True)
    key = ((id(model),), ())  # (walked whole, read alone)
    other = types.SimpleNamespace()  # a stand-in where the module was: the weakref no longer
    walks._kept[key].refs = [lambda: other]  # names this module
    got = walks.reached([model], fresh=False)
    assert {id(t) for t in got} >= {id(p) for p in model.parameters()}
    assert walks._kept[key].refs[0]() is model


def test_the_snapshot_tells_which_small_tensor_changed_and_gives_its_bits_back():
    small = [torch.zeros(3), torch.arange(5, dtype=torch.int64), torch.tensor([True, False]),
             torch.zeros(2, dtype=torch.complex64), torch.zeros(4, dtype=torch.bfloat16)]
    big = torch.nn.Parameter(torch.zeros(2))
    state = _reach.State([*small, big])
    assert len(state.small) == len(small) and [t for t, _ in state.versions] == [big]
    assert [bool(f) for f in state.flags()] == [False]
    assert state.changed() == []
    small[1].add_(1)
    small[3].imag.fill_(float("nan"))
    assert [bool(f) for f in state.flags()] == [True]
    changed = state.changed()
    assert [t for t, _ in changed] == [small[1], small[3]]
    for t, before in changed:
        assert _reach.State.restore(t, before)
    assert torch.equal(small[1], torch.arange(5))
    assert not small[3].isnan().any()
    assert [bool(f) for f in state.flags()] == [False]


def test_a_small_tensor_that_changes_shape_or_a_parameter_written_in_place_is_seen():
    t = torch.zeros(3)
    p = torch.nn.Parameter(torch.zeros(2))
    state = _reach.State([t, p])
    assert not state.host_changed()
    with torch.no_grad():
        p.add_(1)
    assert state.host_changed()
    t.resize_(4)
    assert [bool(f) for f in state.flags()] == [True]
    assert [u for u, _ in state.changed()][:1] == [t]
    # grown, in another storage: not given its bytes back (``restore`` refuses another size)
    assert state.changed()[0][1] is None
    assert not _reach.State.restore(t, state.snapshots[torch.device("cpu")][1][:12])


def test_a_fresh_walk_is_done_once_a_round_for_one_set_of_modules():
    model = _model(_Config())
    walks = _reach.Walks()
    walks.reached([model], fresh=True)
    model[0].late = torch.ones(3)
    # another region of the same round, same modules (megatron's layers share the block)
    assert id(model[0].late) not in {id(t) for t in walks.reached([model], fresh=True)}
    walks.new_round()
    assert id(model[0].late) in {id(t) for t in walks.reached([model], fresh=True)}


_CHANGES = {  # what a step may do to the modules between two rounds -> (the new tensor, walks)
    "a new attribute": lambda m, t: setattr(m[0], "late", t),
    "an attribute rebound, the old tensor kept": lambda m, t: setattr(m[0], "held", t),
    "None replaced by a tensor": lambda m, t: setattr(m[2], "route", t),
    "put into a dict attribute": lambda m, t: m[1].cache.__setitem__("k", t),
    "put into a list attribute": lambda m, t: m[1].slots.__setitem__(0, t),
    "put into a dict inside a dict": lambda m, t: m[1].cache["inner"].__setitem__("k", t),
    "rebound on the shared plain object": lambda m, t: setattr(m[0].config, "table", t),
    # the module the walk went into the shared object through lets go of it: what it holds is
    # still another module's (a fresh walk: that module never went into it)
    "the shared object dropped by its first holder": lambda m, t: (
        delattr(m[0], "config"), setattr(m[1].config, "table", t)),
}


@pytest.fixture(params=["tags", "identities"])
def compared_by(request, monkeypatch):
    """The once-a-round check by the dicts' version tags (this interpreter's, where it has
    them) or, as where it has none, by identity."""
    from fixes.sanitize import _dictversion

    if request.param == "tags" and _dictversion.tag is None:
        pytest.skip(f"no dict version tags on {sys.implementation.name} "
                    f"{sys.version.split()[0]} (fixes.sanitize._dictversion's self-test)")
    if request.param == "identities":
        monkeypatch.setattr(_dictversion, "tag", None)
    return request.param


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_walk_checked_each_round_finds_what_a_fresh_walk_would(monkeypatch, change,
                                                                 compared_by):
    """``values="all"`` (fresh=True): a round's first region checks the kept walk -- each
    module's attributes and the members of every object the walk went into, by identity --
    instead of walking again (two walks of megatron's GPT+MTP block a step were the largest
    part of ``all``'s host time on the H200), and finds what a fresh walk would."""
    calls = _counting(monkeypatch)
    model = _model(_Config())
    model[1].cache, model[1].slots, model[2].route = {"inner": {"n": 1.5}}, [None], None
    old = model[0].held = torch.ones(2)
    walks = _reach.Walks()
    with walks.watching():
        first = {id(t) for t in walks.reached([model], fresh=True)}
        walks.new_round()
        assert {id(t) for t in walks.reached([model], fresh=True)} == first
        assert len(calls) == 1 and walks.rescanned == 0  # nothing changed: no walk, no scan
        new = torch.full((3,), 7.0)
        _CHANGES[change](model, new)
        walks.new_round()
        got = {id(t) for t in walks.reached([model], fresh=True)}
    assert len(calls) == (2 if change.startswith("the shared object dropped") else 1)
    assert got == {id(t) for t in _reach.reached([model])}
    assert id(new) in got and old is not None


def test_a_checked_walk_reads_again_only_what_changed(monkeypatch, compared_by):
    """megatron's token dispatcher, a plain object of its MoE layer holding the config every
    module holds, rebinds its routing tensors every forward: the check reads the dispatcher
    again, not the config's hundreds of fields (that was most of a check on the H200)."""
    config = _Config()
    model = _model(config)
    model[1].dispatcher = types.SimpleNamespace(config=config, routing=torch.zeros(2))
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=True)
        reads = []
        attribute = _reach._Scan._attribute
        monkeypatch.setattr(_reach._Scan, "_attribute",
                            lambda self, value, depth: reads.append(1) or
                            attribute(self, value, depth))
        for _ in range(3):
            routing = model[1].dispatcher.routing = torch.ones(2)
            walks.new_round()
            got = {id(t) for t in walks.reached([model], fresh=True)}
            assert id(routing) in got and id(config.table) in got
    assert walks.walked == 1 and walks.rescanned == 3
    assert len(reads) <= 3 * 4  # the dispatcher and its fields, not the config's


def test_a_dicts_version_tag_moves_with_every_change_where_the_interpreter_has_one():
    """The tag the check reads (``_dictversion``): CPython 3.11 and 3.12 keep it in every dict
    and change it with every change, attribute stores into a plain object's ``__dict__``
    included; the suite's interpreters have it (the check's fast path is what CI runs)."""
    from fixes.sanitize import _dictversion

    if sys.implementation.name == "cpython" and sys.version_info[:2] in ((3, 11), (3, 12)):
        assert _dictversion.tag is not None
    if _dictversion.tag is None:
        pytest.skip(f"no dict version tags on {sys.version.split()[0]}")
    m = torch.nn.Linear(2, 2)
    fields = vars(m)
    seen = [_dictversion.tag(fields)]
    for change in (lambda: setattr(m, "late", torch.ones(1)),  # Module.__setattr__
                   lambda: setattr(m, "late", torch.ones(1)),
                   lambda: object.__setattr__(m, "other", 1),
                   lambda: fields.__setitem__("direct", 2),
                   lambda: delattr(m, "late")):
        change()
        seen.append(_dictversion.tag(fields))
    assert len(set(seen)) == len(seen)


def test_an_interpreter_whose_tags_do_not_move_is_not_trusted(monkeypatch):
    """3.13 stores an attribute into an object's inline values without touching its dict's
    tag: the self-test finds a tag that does not move, and the check compares identities."""
    from fixes.sanitize import _dictversion

    monkeypatch.setattr(_dictversion, "_read", lambda d: 7)
    assert not _dictversion._behaves()


def test_a_module_is_compared_attribute_by_attribute_only_where_its_dict_moved(monkeypatch):
    """By tags, a round in which nothing changed compares no module's attributes one by one
    (that was most of values="all"'s reach on the GPU hosts); a module given a new attribute
    is, alone."""
    from fixes.sanitize import _dictversion

    if _dictversion.tag is None:
        pytest.skip(f"no dict version tags on {sys.version.split()[0]}")
    model = _model(_Config())
    one_by_one = []
    changed = _reach._changed
    monkeypatch.setattr(_reach, "_changed",
                        lambda sub, shape: one_by_one.append(sub) or changed(sub, shape))
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=True)
        walks.new_round()
        walks.reached([model], fresh=True)
        assert one_by_one == []
        model[1].late = torch.ones(2)
        walks.new_round()
        got = {id(t) for t in walks.reached([model], fresh=True)}
    assert one_by_one == [model[1]] and id(model[1].late) in got


def test_a_dict_reordered_in_place_is_read_again(compared_by):
    """``OrderedDict.move_to_end`` reorders a dict without moving its tag, and a walk reads a
    container's first 64 members: an LRU cache of tensors on a module, reordered, holds a
    tensor a fresh walk finds and a walk checked by tags alone did not (a review of 6664033:
    only exact dicts are trusted by their tag)."""
    import collections

    m = torch.nn.Linear(2, 2)
    m.cache = collections.OrderedDict((f"k{i}", torch.full((1,), float(i))) for i in range(65))
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([m], fresh=True)
        m.cache.move_to_end("k0")
        walks.new_round()
        got = {id(t) for t in walks.reached([m], fresh=True)}
    assert got == {id(t) for t in _reach.reached([m])}


def test_a_change_between_a_shapes_ids_and_its_tags_is_not_taken_into_the_tags(monkeypatch):
    """The tags are read after the ids they stand for: an attribute set in between (another
    thread, a finaliser) would be in the tags and in no shape, and never seen; the ids are read
    again after the tags, and a shape whose ids moved keeps no tags (a review of 6664033)."""
    from fixes.sanitize import _dictversion

    if _dictversion.tag is None:
        pytest.skip(f"no dict version tags on {sys.version.split()[0]}")
    m = torch.nn.Linear(2, 2)
    m.cfg = {"a": 1}
    late = torch.ones(3)
    tags = _reach._tags

    def meddling(attributes, ids, into):
        if not hasattr(m, "extra"):
            m.extra = late
        return tags(attributes, ids, into)

    monkeypatch.setattr(_reach, "_tags", meddling)
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([m], fresh=True)
        walks.new_round()
        assert id(late) in {id(t) for t in walks.reached([m], fresh=True)}


def _counting(monkeypatch) -> list:
    calls = []
    walk = _reach._walk
    monkeypatch.setattr(_reach, "_walk",
                        lambda *modules: calls.append(1) or walk(*modules))
    return calls


def test_a_kept_walk_lasts_across_rounds_while_nothing_it_could_miss_changed(monkeypatch):
    """``values="sampled"`` / ``"none"`` (fresh=False): one walk for many steps -- the fresh
    walk of megatron's module tree was most of those modes' host time a step."""
    calls = _counting(monkeypatch)
    model = _model(_Config())
    walks = _reach.Walks()
    with walks.watching():
        for _ in range(_reach.REWALK_ROUNDS - 1):
            got = walks.reached([model], fresh=False)
            walks.new_round()
    assert len(calls) == walks.walked == 1
    assert {id(p) for p in model.parameters()} <= {id(t) for t in got}


@pytest.mark.parametrize("how", ["buffer", "parameter", "module"])
def test_a_registration_anywhere_makes_the_next_walk_fresh(monkeypatch, how):
    calls = _counting(monkeypatch)
    model = _model(_Config())
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=False)
        walks.new_round()
        if how == "buffer":
            model[0].register_buffer("late", torch.ones(3))
            late = model[0].late
        elif how == "parameter":
            model[1].late = torch.nn.Parameter(torch.ones(3))
            late = model[1].late
        else:
            model[2].sub = torch.nn.Linear(2, 2)
            late = model[2].sub.weight
        got = walks.reached([model], fresh=False)
    assert len(calls) == 2
    assert id(late) in {id(t) for t in got}


def test_a_rebound_attribute_whose_old_tensor_died_is_seen_from_the_next_region():
    """Megatron's token dispatcher rebinds its routing state each forward."""
    model = _model(_Config())
    model[0].cache = torch.zeros(2)
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=False)
        model[0].cache = torch.ones(2)  # the old tensor is freed: its weak reference died
        got = walks.reached([model], fresh=False)
    assert id(model[0].cache) in {id(t) for t in got}
    assert walks.walked == 1 and walks.rescanned == 1  # that module alone, scanned again


def _visits(monkeypatch) -> list:
    """Every value ``_reach._Scan._attribute`` visits from now on."""
    visited: list = []
    attribute = _reach._Scan._attribute
    monkeypatch.setattr(_reach._Scan, "_attribute",
                        lambda self, value, depth: visited.append(value)
                        or attribute(self, value, depth))
    return visited


def test_a_rescan_visits_only_the_attributes_that_held_a_tensor(monkeypatch):
    """Each region of megatron's MoE layer rescans its token dispatcher (rebound routing
    state): the rescan must not walk what held no tensor at the walk (megatron's modules hold
    a config of hundreds of plain fields) again -- the rescans were the largest sanitizer
    cost of a left-on ``values="none"`` step with MoE-layer recompute on CPU."""
    model = _model(_Config())
    model[0].settings = types.SimpleNamespace(**{f"field_{i}": i for i in range(200)})
    model[0].cache = {"routing": torch.zeros(2)}
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=False)
        visited = _visits(monkeypatch)
        model[0].cache = {"routing": torch.ones(2)}  # rebound: the old tensor is freed
        got = walks.reached([model], fresh=False)
    assert walks.rescanned == 1
    assert id(model[0].cache["routing"]) in {id(t) for t in got}
    # the dict and its tensor, and the config that held a tensor: not the fields of a plain
    # object that held none
    assert model[0].settings not in visited and len(visited) <= 205


def test_a_rescan_of_a_plain_object_visits_only_its_fields_that_held_a_tensor(monkeypatch):
    """megatron's token dispatcher is a plain object: its rebound routing tensors beside the
    config it holds (hundreds of fields). Its rescan reads the fields that held tensors, not
    the config again (400 attribute visits a step, the rescans' whole cost, on a 4-layer MoE
    with MoE-layer recompute)."""
    model = _model(_Config())
    config = types.SimpleNamespace(**{f"field_{i}": i for i in range(200)})
    model[0].dispatcher = types.SimpleNamespace(config=config, probs=torch.zeros(2), topk=2,
                                                routing_map=None)
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=False)
        visited = _visits(monkeypatch)
        model[0].dispatcher.probs = torch.ones(2)  # rebound: the old tensor is freed
        got = walks.reached([model], fresh=False)
    assert walks.rescanned == 1
    assert id(model[0].dispatcher.probs) in {id(t) for t in got}
    assert config not in visited and len(visited) <= 3


def test_a_tensor_attached_where_no_hook_sees_it_is_seen_within_rewalk_rounds():
    model = _model(_Config())
    walks = _reach.Walks()
    with walks.watching():
        walks.reached([model], fresh=False)
        model[0].late = torch.ones(3)  # a plain tensor attribute: no registration hook runs
        for _ in range(_reach.REWALK_ROUNDS - 1):
            walks.new_round()
            assert id(model[0].late) not in {id(t) for t in walks.reached([model], fresh=False)}
        walks.new_round()
        assert id(model[0].late) in {id(t) for t in walks.reached([model], fresh=False)}


def test_the_registration_hooks_go_when_the_walks_stop_watching():
    from torch.nn.modules import module as nn_module

    hooks = (nn_module._global_parameter_registration_hooks,
             nn_module._global_buffer_registration_hooks,
             nn_module._global_module_registration_hooks)
    before = [len(h) for h in hooks]
    walks = _reach.Walks()
    with walks.watching():
        assert [len(h) for h in hooks] == [n + 1 for n in before]
        with pytest.raises(RuntimeError, match="already watching"):
            with walks.watching():
                pass
    assert [len(h) for h in hooks] == before


def test_a_backwards_regions_are_compared_in_one_pass_then_each_where_one_changed():
    # _reach.any_changed: every region's small state of one backward in one comparison;
    # changed_flags: each region's own (a write into one region's state flags it only)
    tensors = [[torch.zeros(3), torch.ones(2, dtype=torch.int64)], [torch.zeros(5)],
               [torch.tensor([True]), torch.zeros(4, dtype=torch.bfloat16)]]
    states = [_reach.State(ts) for ts in tensors]

    def items():  # unsettled: the bytes as they are now
        return [(key, *state.pairs()[torch.device("cpu")])
                for key, state in zip("abc", states, strict=True)]

    assert [(k, bool(f)) for k, f in _reach.changed_flags(items())] == [
        ("a", False), ("b", False), ("c", False)]
    assert not bool(_reach.any_changed(items()))
    tensors[1][0][4] = 1.0
    assert bool(_reach.any_changed(items()))
    tensors[2][1][0] = -0.0  # another bit pattern, an equal value
    assert [(k, bool(f)) for k, f in _reach.changed_flags(items())] == [
        ("a", False), ("b", True), ("c", True)]
    tensors[0][0].resize_(4)  # another shape: changed, with no comparison
    assert states[0].pairs()[torch.device("cpu")] is None


def test_a_small_tensor_given_another_storage_is_seen_changed():
    # The snapshot's byte views alias the storage the tensor had; a recompute that swaps it
    # (``set_``, ``.data =``) leaves them reading the old one: the swap itself must count.
    for swap in (lambda t: t.set_(torch.ones(3)), lambda t: setattr(t, "data", torch.ones(3))):
        t = torch.zeros(3)
        state = _reach.State([t])
        assert [bool(f) for f in state.flags()] == [False]
        swap(t)
        assert [bool(f) for f in state.flags()] == [True]
        assert [u for u, _ in state.changed()] == [t]


def test_a_kept_walks_parameters_are_read_without_sorting_them_again(monkeypatch):
    """A kept walk's parameters come as compared by counter from the walk: a region reading it
    sorts only the other tensors (buffers, attributes: few, and sorted anew because they may
    have been resized or swapped) and its own arguments -- every region of megatron's block
    reaches every parameter of the block, and sorting them was most of ``values="none"``'s
    host time a region."""
    model = _model(_Config())
    walks = _reach.Walks()
    walks.reach([model], fresh=False)
    sorted_ids: list[int] = []
    of = _reach.Reached.of.__func__
    monkeypatch.setattr(_reach.Reached, "of", classmethod(
        lambda cls, ts: sorted_ids.extend(map(id, ts)) or of(cls, ts)))
    arg = torch.ones(2)
    got = walks.reach([model, arg], fresh=False)
    assert not {id(p) for p in model.parameters()} & set(sorted_ids)
    assert id(arg) in sorted_ids
    assert {id(t) for t in got.versioned} == {id(p) for p in model.parameters()}
    assert {id(t) for t in got.small} == {id(t) for t in (arg, *model.buffers(),
                                                           model[0].config.table)}


def test_settle_lets_go_of_every_tensor_whose_counter_did_not_move():
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    state = _reach.State(_reach.Reached([], [p, q]))
    with torch.no_grad():
        q.add_(1)
    state.settle()
    assert [t for t, _ in state.versions] == [q] and state.host_changed()
    quiet = _reach.State(_reach.Reached([], [p]))
    quiet.settle()
    assert quiet.versions == [] and not quiet.host_changed()


def test_a_module_gone_with_its_dead_tensor_makes_the_walk_fresh():
    model = _model(_Config())
    model[0].cache = torch.zeros(2)
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        del model[0]  # no registration hook sees a deletion; its tensors die with it
        got = walks.reached([model], fresh=False)
    assert walks.walked == 2
    assert {id(t) for t in got} >= {id(p) for p in model.parameters()}


def _kept_state(walks, model) -> _reach.State:
    """A State from the kept walk (``fresh=False``: values="none" / "sampled")."""
    return _reach.State(walks.reach([model], fresh=False))


def test_a_kept_buffer_that_became_small_is_compared_by_its_bits():
    """Sorted anew at each read: a buffer over ``SMALL_STATE_BYTES`` at the walk, swapped for a
    small one (``.data =``) and then written without a counter bump (``.data``'s own counter,
    as batch norm's statistics), is seen (a review of 5af0964: the kept class missed it)."""
    model = torch.nn.Module()
    model.register_buffer("stat", torch.zeros(_reach.SMALL_STATE_BYTES))
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=True)
        model.stat.data = torch.zeros(4)
        state = _kept_state(walks, model)
        with torch.no_grad():
            model.stat.data.add_(1)
    state.settle()
    assert [bool(f) for f in state.flags()] == [True]
    assert [t for t, _ in state.changed()] == [model.stat]


def test_a_kept_buffer_that_grew_is_compared_by_counter_not_copied():
    model = torch.nn.Module()
    model.register_buffer("cache", torch.empty(0))
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=True)
        model.cache.resize_(_reach.SMALL_STATE_BYTES)  # 4x the small state's bound, in floats
        state = _kept_state(walks, model)
    assert state.small == [] and state.snapshots == {}
    assert [t for t, _ in state.versions] == [model.cache]


def test_a_parameter_materialised_from_meta_after_the_walk_is_compared():
    model = torch.nn.Linear(2, 2, device="meta")
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=True)
        model.to_empty(device="cpu")  # the same Parameter objects, given storage
        state = _kept_state(walks, model)
        with torch.no_grad():
            model.weight.add_(1)
    assert state.host_changed()


def test_a_rescan_adds_no_tensor_twice():
    """A rescanned module's parameters come back with the rescan; one another module also
    holds (tied weights) must not then be compared, and reported, twice."""
    emb, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    head.route = torch.zeros(2)
    model = torch.nn.ModuleList([emb, head])
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        head.route = torch.ones(2)  # rebound: ``head`` is scanned again
        got = list(walks.reach([model], fresh=False))
    assert walks.rescanned == 1
    assert len(got) == len({id(t) for t in got}) == 2


def test_a_fresh_walk_answers_from_the_walk_not_from_a_read_of_it(monkeypatch):
    """``_Kept.read`` answers None where a found tensor was freed unmarked (another Python
    thread, between the marks and the read); a fresh walk has the tensors in hand and must
    not depend on reading them back."""
    model = _model(_Config())
    monkeypatch.setattr(_reach._Kept, "read", lambda self: (None, 0))
    got = _reach.Walks().reach([model], fresh=True)
    assert {id(t) for t in got.versioned} == {id(p) for p in model.parameters()}


def test_a_module_scanned_again_every_round_is_read_apart_not_joined_again(monkeypatch):
    """megatron's token dispatcher rebinds its routing tensors every forward, so its module is
    scanned again at every read; the walk's flat lists (the block's parameters) are joined
    again once, when it is first scanned, not at every read (that join and the dedupe after
    it were most of a region's read on megatron's MoE), and what a read finds is unchanged:
    each tensor once, the rebound one and the region's own arguments among them."""
    model = _model(_Config())
    model[1].route = torch.zeros(2)
    joins = []
    join = _reach._Kept._join
    monkeypatch.setattr(_reach._Kept, "_join", lambda self: joins.append(1) or join(self))
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        for k in range(5):
            model[1].route = torch.full((2,), float(k))  # the old one freed: a rescan
            arg = torch.ones(3)
            for roots in ([model, arg], [model, arg, model[1].route]):
                ids = [id(t) for t in walks.reach(roots, fresh=False)]
                assert len(ids) == len(set(ids))
                assert {id(model[1].route), id(arg)} <= set(ids)
                assert {id(p) for p in (*model.parameters(), *model.buffers())} <= set(ids)
    assert walks.walked == 1 and walks.rescanned == 5
    assert len(joins) == 2  # the walk's, and the first rescan's


def test_a_walk_kept_for_none_or_sampled_keeps_no_shape(monkeypatch):
    """``_shape`` is what ``check`` (values="all") compares: a walk for the other modes does
    not compute it; asked fresh, such a walk is walked anew (with it)."""
    calls = []
    shape = _reach._shape
    monkeypatch.setattr(_reach, "_shape", lambda *a: calls.append(1) or shape(*a))
    model = _model(_Config())
    walks = _reach.Walks()
    walks.reach([model], fresh=False)
    walks.new_round()
    walks.reach([model], fresh=False)
    assert calls == [] and walks.walked == 1
    walks.new_round()
    got = walks.reach([model], fresh=True)
    assert calls and walks.walked == 2
    assert {id(p) for p in model.parameters()} <= {id(t) for t in got}


def test_a_sparse_tensor_the_region_reaches_is_sorted_and_left_uncompared():
    """A sparse COO buffer or argument (a graph's adjacency) has no ``nbytes``: sorted by its
    element count as before, and left out by ``State`` (neither readable nor strided), not an
    error (a review of fd11831: ``Reached.of`` raised on it)."""
    module = torch.nn.Module()
    module.register_buffer("adj", torch.eye(3).to_sparse())
    arg = torch.eye(2).to_sparse()
    found = _reach.Walks().reach([module, arg], fresh=False)
    assert {id(t) for t in found.small} == {id(module.adj), id(arg)}
    state = _reach.State(found)
    assert state.small == [] and state.versions == []


def _two_holding_one():
    """Two modules holding one plain tensor, each under its own attribute (megatron's layers
    share routing and RoPE tensors this way); the walk meets it in ``a`` first."""
    shared = torch.zeros(2)
    a, b = torch.nn.Module(), torch.nn.Module()
    a.x, b.y = shared, shared
    return torch.nn.ModuleList([a, b]), a, b


def _checked_after_rebinding(root, holder):
    """A fresh walk of ``root`` (values="all"), ``holder.x`` rebound, the walk checked on the
    next round: the walks and the ids of what that round's reach found."""
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([root], fresh=True)
        holder.x = torch.ones(3)
        walks.new_round()
        got = {id(t) for t in walks.reach([root], fresh=True)}
    return walks, got


def test_a_tensor_two_modules_hold_stays_reached_when_the_first_rebinds_it():
    """Checked each round (values="all"): ``a`` rebinds its attribute, the tensor lives on in
    ``b``. A walk that credited it to ``a`` alone lost it with ``a``'s rescan until the next
    fresh walk; a fresh walk finds both, so the checked walk must too."""
    model, a, b = _two_holding_one()
    walks, got = _checked_after_rebinding(model, a)
    assert walks.walked == 1
    assert {id(a.x), id(b.y)} <= got


def test_both_modules_holding_a_freed_tensor_are_scanned_again():
    """Both let go of the tensor they shared (it dies): each holder is scanned again, not only
    the module the walk met it in first, so ``b``'s new tensor is reached in every mode."""
    model, a, b = _two_holding_one()
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        a.x, b.y = torch.ones(3), torch.full((4,), 2.0)
        got = [id(t) for t in walks.reach([model], fresh=False)]
    assert walks.walked == 1 and walks.rescanned == 2
    assert len(got) == len(set(got))
    assert {id(a.x), id(b.y)} <= set(got)


def test_the_small_state_is_judged_as_the_recompute_left_it_not_as_it_is_later():
    """``settle`` (the recompute's end) freezes the small tensors' bytes: a write after it
    (a later region's recompute, the backward, a final callback, the next forward) is not
    the recompute's -- a comparison at the backward's end took it for theirs."""
    t, u = torch.zeros(3), torch.zeros(2)
    state = _reach.State([t, u])
    u.add_(1)  # the recompute's own write
    state.settle()
    t.add_(1)  # after it
    t.resize_(5)
    assert [bool(f) for f in state.flags()] == [True]
    assert [x for x, _ in state.changed()] == [u]
    quiet = _reach.State([t])
    quiet.settle()
    t.add_(1)
    t.set_(torch.ones(2))
    assert [bool(f) for f in quiet.flags()] == [False] and quiet.changed() == []


def test_a_module_bound_by_a_default_argument_is_reached():
    """``def f(h, layer=layer)``: binding a loop's layer by a default argument is the usual
    way around late-binding closures; the layer is the function's as much as a closure's."""
    layer, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    layer.register_buffer("calls", torch.zeros(()))

    def f(h, layer=layer, *, other=other):
        return other(layer(h))

    found = {id(t) for t in _reach.reached([f])}
    assert {id(t) for t in (*layer.parameters(), layer.calls, *other.parameters())} <= found


@pytest.mark.parametrize("swap", ["data", "set_"])
def test_a_small_tensor_given_a_storage_of_equal_bytes_is_no_change(swap):
    """A table rebuilt and bound anew (``.data =``, ``set_``) with the bytes it had: the swap
    moves the data pointer, the bytes are read where they are now and compared (a review of
    ee39c4f: taken for changed without a comparison)."""
    t = torch.ones(4)
    state = _reach.State([t])
    if swap == "data":
        t.data = torch.ones(4)
    else:
        t.set_(torch.ones(4))
    state.settle()
    assert [bool(f) for f in state.flags()] == [False] and state.changed() == []


@pytest.mark.parametrize("make", [lambda: torch.zeros(4, 3).t(),
                                  lambda: torch.zeros(3, dtype=torch.complex64).conj()],
                         ids=["transposed", "conjugate"])
def test_a_write_into_a_small_tensor_whose_bytes_are_a_copy_is_seen(make):
    """A transposed buffer or a conjugate complex one has no byte view: ``_bytes`` copies it,
    and a copy taken at the snapshot, kept as its "view", froze it -- the recompute's write
    was never seen (a review of ee39c4f). Its bytes are read again at ``settle``."""
    t = make()
    state = _reach.State([t])
    t.add_(1)
    state.settle()
    assert [bool(f) for f in state.flags()] == [True]
    assert [u for u, _ in state.changed()] == [t]


def test_a_changed_tensor_given_another_storage_since_is_not_given_its_bytes_back():
    """``restore`` writes into the storage the tensor has when the flush judges it: one given
    another tensor's storage after the recompute (``set_``) is reported, not restored (its
    bytes from before would land in the other tensor)."""
    t, other = torch.zeros(3), torch.full((3,), 7.0)
    state = _reach.State([t])
    t.add_(1)
    state.settle()
    t.set_(other)
    assert [(u, before) for u, before in state.changed()] == [(t, None)]


def test_a_tensor_under_two_attributes_of_one_module_stays_reached_when_one_is_rebound():
    """One tensor under two attributes of a module (directly, and in a plain object it holds):
    both attributes are where it was found, so a rescan of the rebound one leaves it reached
    through the other, as a fresh walk would (a review of 49a75f3)."""
    t = torch.zeros(2)
    a = torch.nn.Module()
    a.x, a.cfg = t, types.SimpleNamespace(t=t)
    walks, got = _checked_after_rebinding(a, a)
    assert walks.walked == 1 and {id(t), id(a.x)} <= got


def test_a_reached_tensor_is_named_by_its_path_from_the_outermost_module():
    block = torch.nn.Module()
    block.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    block.layers[0].dispatcher = types.SimpleNamespace(counts=torch.zeros(2))
    arg, stray = torch.ones(2), torch.ones(2)
    roots = [block.layers[0], block, arg]  # the inner module first: the outer one names it
    assert _reach.tensor_name(block.layers[0].weight, roots) == "Module.layers.0.weight"
    assert _reach.tensor_name(block.layers[0].dispatcher.counts, roots) == (
        "Module.layers.0.dispatcher.counts")
    assert _reach.tensor_name(arg, roots) == "the region's argument"
    assert _reach.tensor_name(stray, roots) is None


def test_the_snapshot_reads_each_kind_of_small_tensor_by_its_own_bits():
    """Mixed dtypes in one buffer; a transposed tensor (its "view" a copy: read again at the
    end), a negative-bit view, complex and float8 each read by their own bits; the changed
    ones named in the order the region reaches them, and given their bits back (all but the
    negative-bit view, which ``restore`` refuses)."""
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    small = [torch.zeros(3), torch.arange(4, dtype=torch.int64), base.t(),
             torch._neg_view(torch.ones(2)), torch.zeros(2, dtype=torch.complex64),
             torch.tensor([True]), torch.zeros(5), torch.zeros(2, dtype=torch.float8_e4m3fn)]
    state = _reach.State(small)
    assert len(state.small) == len(small)
    indices, snapshot = state.snapshots[torch.device("cpu")]
    assert sorted(indices) == list(range(len(small)))
    assert snapshot.numel() == sum(t.numel() * t.element_size() for t in small)
    assert [bool(f) for f in state.flags()] == [False]
    before = [t.clone() for t in small]
    base[1, 2] = 50.0  # through the transposed view's storage
    small[3].add_(1.0)  # -1 -> 0 through the negative bit
    small[6][4] = 1.0
    small[7].view(torch.uint8)[1] = 1
    assert [bool(f) for f in state.flags()] == [True]
    changed = state.changed()
    assert [id(t) for t, _ in changed] == [id(small[i]) for i in (2, 3, 6, 7)]
    # given back, all but the negative-bit view (its bits are no view of it: ``restore``)
    assert [_reach.State.restore(t, bits) for t, bits in changed] == [True, False, True, True]
    small[3].sub_(1.0)
    for t, b in zip(small, before, strict=True):
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert [bool(f) for f in state.flags()] == [False]


def _megatron_like_block(n: int):
    """megatron's ``TransformerBlock``: layers in a ``ModuleList``, a buffer of its own, and
    each layer's region a closure over the whole block (``self._get_layer(index)``)."""
    block = torch.nn.Module()
    block.layers = torch.nn.ModuleList()
    for _ in range(n):
        layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        layer.register_buffer("calls", torch.zeros(()))
        block.layers.append(layer)
    block.register_buffer("step", torch.zeros(()))

    def region(i):
        def custom(h):
            return block.layers[i](h)
        return custom
    return block, region


def _ids(tensors) -> set[int]:
    return set(map(id, tensors))


@pytest.mark.parametrize("walked", ["kept", "plain"])
def test_a_region_reaches_the_modules_its_forward_ran_and_its_roots_own_state(walked):
    """The block in each layer's region's closure: the region reaches the layer that ran (its
    subtree) and the block's own buffer, not the other layers' parameters and buffers."""
    block, region = _megatron_like_block(3)
    layer = block.layers[1]
    ran = [layer, *layer]  # as ``_ran`` records it: the layer, then its submodules
    walks = _reach.Walks()
    got = _ids(walks.reached([region(1)], fresh=True, ran=ran) if walked == "kept"
               else _reach.reached([region(1)], ran=ran))
    assert got == _ids([*layer.parameters(), *layer.buffers(), block.step])


def test_a_root_none_of_whose_modules_ran_is_reached_whole():
    """A function that reads a module's parameters without calling it (``F.linear(x,
    norm.weight)``): nothing of it ran, all of it is reached; so with no record at all."""
    block, region = _megatron_like_block(2)
    norm = torch.nn.LayerNorm(4)

    def f(h):
        return torch.nn.functional.layer_norm(block.layers[0](h), (4,), norm.weight, norm.bias)

    ran = [block.layers[0], *block.layers[0]]
    everything = _ids([*block.parameters(), *block.buffers(), *norm.parameters()])
    assert _ids(_reach.reached([f], ran=ran)) == everything - _ids(
        [*block.layers[1].parameters(), *block.layers[1].buffers()])
    assert _ids(_reach.reached([f], ran=None)) == everything
    assert _ids(_reach.reached([f], ran=[])) == everything


def test_a_submodule_called_without_its_parent_leaves_the_modules_between_read_alone():
    """The region calls one layer's linear directly (the layer's ``forward`` called as a
    method, not through ``__call__``: not recorded): that linear is the outermost module that
    ran and is walked whole; the block, the layer list and the layer between them are read
    alone -- the layer's own buffer is reached (a review of cb82629: it was not, and a write
    to it went unseen), its other submodules' state is not."""
    block, region = _megatron_like_block(2)
    layer = block.layers[0]
    lin = layer[0]

    def f(h):
        return lin(h)

    assert _ids(_reach.reached([f, block], ran=[lin])) == _ids(
        [*lin.parameters(), layer.calls, block.step])
    # ``lin`` is also a root of its own: walked whole, not twice
    assert len(_reach.reached([f, block, lin], ran=[lin])) == 4


@pytest.mark.parametrize("fresh", [True, False])
def test_a_submodule_deleted_since_is_seen_by_a_tree_read_anew(fresh):
    """No hook sees ``del module.sub``: the kept tree of a root is read anew once a round
    where ``fresh`` (values="all"), else once it is ``REWALK_ROUNDS`` rounds old; then a module
    that ran but is no longer the root's no longer narrows it."""
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    model.a.register_buffer("count", torch.zeros(()))
    b = model.b
    walks = _reach.Walks()
    with walks.watching():
        assert id(model.a.count) not in _ids(walks.reached([model], fresh=fresh, ran=[b]))
        del model.b
        walks.new_round()
        seen = id(model.a.count) in _ids(walks.reached([model], fresh=fresh, ran=[b]))
        assert seen == fresh
        for _ in range(_reach.REWALK_ROUNDS):
            walks.new_round()
        assert id(model.a.count) in _ids(walks.reached([model], fresh=fresh, ran=[b]))


def test_walks_let_go_of_what_can_no_longer_hold():
    """A kept walk or tree ``REWALK_ROUNDS`` rounds old is never read again: let go (keys
    depend on which modules ran, so a region calling a varying set would add one a step)."""
    block, region = _megatron_like_block(3)
    walks = _reach.Walks()
    for i in range(3):
        walks.reach([region(i)], fresh=False, ran=[block.layers[i]])
    assert len(walks._kept) == 3 and walks._trees
    for _ in range(_reach.REWALK_ROUNDS):
        walks.new_round()
    assert walks._kept == {} and walks._trees == {}


def test_a_region_of_a_deeper_block_reads_as_many_tensors():
    """What a layer's region reaches does not grow with the number of layers (it grew as the
    block, and a step's host time with the square of its depth)."""
    sizes = []
    for n in (2, 8):
        block, region = _megatron_like_block(n)
        walks = _reach.Walks()
        layer = block.layers[n - 1]
        found = walks.reach([region(n - 1)], fresh=False, ran=[layer, *layer])
        sizes.append((len(found.small), len(found.versioned)))
    assert sizes[0] == sizes[1]


def test_the_kept_walk_of_a_narrowed_region_sees_a_layer_registered_since(monkeypatch):
    """The subtree a narrowing reads is kept while no module is registered: a layer appended
    to the block since (a registration) is reached by its own region."""
    block, region = _megatron_like_block(1)
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([region(0)], fresh=False, ran=[block.layers[0]])
        block.layers.append(torch.nn.Linear(4, 4))
        new = block.layers[1]
        got = _ids(walks.reached([region(1)], fresh=False, ran=[new]))
    assert got == _ids([*new.parameters(), block.step])


def _readable_cases():
    base = torch.arange(24.0)
    released = torch.zeros(4)
    released.untyped_storage().resize_(0)
    released_view = torch.zeros(8)[2:]
    released_view.untyped_storage().resize_(0)
    shrunk = torch.zeros(16)
    view_past = shrunk[8:]
    shrunk.untyped_storage().resize_(16)  # 4 floats left: the view reads past them
    return {
        "contiguous": base, "0-d": torch.tensor(3), "empty": torch.zeros(0, 3),
        "transposed": base.view(4, 6).t(), "strided": base[::3], "offset": base[5:9],
        "expanded": torch.ones(1, 3).expand(4, 3), "bool": torch.ones(3, dtype=torch.bool),
        "bf16": torch.ones(5, dtype=torch.bfloat16), "released": released,
        "released view": released_view, "past a shrunk storage": view_past,
        "meta": torch.empty(3, device="meta"), "meta view": torch.empty(10, device="meta")[2:],
        "parameter": torch.nn.Parameter(base.clone()),
        "subclass": torch.Tensor._make_subclass(type("Sub", (torch.Tensor,), {}), base),
    }


@pytest.mark.parametrize("name", list(_readable_cases()))
def test_a_signature_answers_readable_as_the_tensor_does(name):
    """``State`` asks whether a small tensor can be read from its signature (``_fits``: no
    call into torch per tensor); it must answer as ``fp.readable`` does -- a released or
    shrunk storage read is a segmentation fault on CPU."""
    from fixes.sanitize import _fingerprint as fp

    t = _readable_cases()[name]
    (signature,) = _reach._signatures([t])
    assert _reach._fits(t, signature) == fp.readable(t)


class _Loud(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` refuses to say where its memory is."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("data_ptr", "stride", "storage_offset",
                                             "untyped_storage"):
            raise ValueError(f"_Loud: {func.__name__} is not for you")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_small_subclass_tensor_is_not_asked_where_its_memory_is():
    """A tensor subclass is no plain tensor: its values are not read (``fp.readable``), and
    the signature read must not ask it either -- that runs its ``__torch_function__``, user
    code (a FakeTensor warns there, this one raises; a review of c7bca23)."""
    loud = torch.Tensor._make_subclass(_Loud, torch.zeros(3))
    state = _reach.State([loud, torch.zeros(2)])
    assert [t is loud for t in state.small] == [False]


def test_a_rebound_value_is_compared_by_counter_what_stays_by_bits():
    """megatron's token dispatcher rebinds its routing map, probs and indices every forward:
    a tensor a rescan finds that the module's scan before it did not hold is compared by
    version counter, not snapshotted bit by bit at each recompute (most of what a MoE region's
    ``values="none"`` cost beyond a GPT region's). What stays keeps its bits compared (batch
    norm updates its statistics with no counter bump): the rescanned module's buffers, a
    plain tensor it kept, another module's buffer it holds, and small tensors of modules not
    scanned again."""
    config = _Config()
    model = _model(config)
    model[1].route = torch.zeros(2)
    model[1].mask = torch.ones(2)  # stays: bits
    model[1].stats_of_0 = model[0].running  # another module's buffer: bits
    walks = _reach.Walks()
    with walks.watching():
        walks.reach([model], fresh=False)
        model[1].route = torch.ones(2)  # the old one freed: ``model[1]`` scanned again
        found = walks.reach([model], fresh=False)
        assert walks.rescanned == 1
        small = {id(t) for t in found.small}
        assert id(model[1].route) in {id(t) for t in found.versioned}
        assert id(model[1].route) not in small
        assert {id(model[1].running), id(model[0].running), id(model[1].mask),
                id(config.table)} <= small
        # a torch write into it is still seen, by its counter
        state = _reach.State(found)
        model[1].route.add_(1)
        state.settle()
        assert any(t is model[1].route for t, _ in state.changed())
        # a value that stayed since the rescan is read by its bits again
        found = walks.reach([model], fresh=False)
        assert id(model[1].route) in {id(t) for t in found.small}
