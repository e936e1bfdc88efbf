"""What a checkpointed region reaches outside itself, and whether its recompute left it changed:
the detect tier's check of writes outside the region (``_detect``).

* ``reached(roots, ran)``: the plain tensors reachable from a region's function and
  arguments -- the tensors among them (and in their closures, default arguments, partials,
  lists, dicts, two levels deep), and every parameter, buffer and tensor attribute of the
  modules among them, narrowed to the modules the region's forward ran (``narrowed``, the
  record of ``_ran``): a module among them that ran, or none of whose submodules ran, whole;
  one some of whose submodules ran, its own tensors and the outermost of those submodules
  whole. Megatron's full recompute checkpoints each layer with the whole block in the
  region's closure: every region reached every layer, a region's host time grew with the
  depth and a step's with its square (``python -m benchmarks.sanitizer_host_time
  --layers``), and the never-recomputed check read the block's trainable layers as a
  frozen bottom layer's. Each module and each plain object is walked once: megatron's
  modules all hold one ``TransformerConfig``, and walking it again under each of an MoE
  layer's thousand modules was most of a sanitized step's host time on the H200
  (``values="none"`` cost 1.41x a step at H=1024).
* ``Walks``: the walk of a region's modules (their subtrees and attributes: the costly part)
  kept per set of modules, across rounds, while nothing it could have missed changed: no
  parameter, buffer or submodule was registered anywhere (torch's global registration hooks,
  held while the sanitizer is entered: ``watching``), and it is fewer than ``REWALK_ROUNDS``
  rounds old (a tensor attached where no hook sees it -- a new plain attribute -- is seen by
  then). A module holding a tensor the walk found that was freed since (an attribute rebound
  to a new tensor: megatron's token dispatcher does it every forward) is scanned again alone,
  in the attributes the walk found tensors under (a tensor under another is a new plain
  attribute: seen by the next fresh walk), and read apart from the others from then on (its
  rescan every round does not join the walk's lists again); the tensors a rescan finds that
  the module's scan before it did not hold (rebound values: the dispatcher's routing map,
  probs and indices) are compared by version counter, not by their bits (``_by_counter``). A
  kept walk holds its tensors
  weakly, its parameters kept as compared by counter (``Reached``) and every other tensor
  sorted anew at each read (a buffer resized or swapped, a parameter materialised from meta
  since the walk), and learns of a death by the weak reference's callback: a region reads it
  with no call per module or parameter (when megatron's layers each reached the whole
  block's parameters, sorting them again per region was most of ``values="none"``'s
  remaining host time, ``benchmarks._sanitize_megatron --profile``). A submodule freed with
  its tensors still alive elsewhere leaves them compared until the next fresh walk (more
  checked, none missed).
  ``fresh`` (the sanitizer asks it for every region in ``values="all"``) asks for a walk
  that finds what a fresh one would: once a round per set of modules the kept walk is
  checked instead of walked again -- each module's attributes, and the members of every
  object the walk went into, by identity (``_shape``), or, where the interpreter keeps them
  (``_dictversion``: CPython 3.11, 3.12), by their dicts' version tags, one number a module;
  a module that differs is scanned
  again alone, one that let go of an object it was the walk's way into makes a fresh walk.
  A fresh walk every round was the largest host cost of ``values="none"`` on megatron's MoE
  (``benchmarks/results/evidence/2026-12-03-cpu-sanitizer-host-profile/``), and, two walks
  of megatron's GPT+MTP block a step, of ``values="all"`` on the H200.
* ``State``: the reached tensors as a recompute found them and as it left them -- small
  non-parameter ones by their bits (batch norm updates its running statistics without
  bumping their version counter), gathered into one byte buffer per device by one ``cat`` at
  the recompute's start and one at its end, so a region costs two copies per device, not a
  few per tensor; the others by version counter, read in one pass (``map``) at the
  recompute's start and end. Judged by what the recompute left, not by what the tensors hold
  when the backward ends: regions that reach one buffer (a block's own, in each layer's
  region) took one layer's recompute's write for every region recomputed before it.
  ``any_changed``: every region of a backward compared in one pass per device, a 0-d device
  tensor true when some small tensor's bits changed (read after the backward's one
  synchronisation); only where it is set, ``changed_flags``: which regions (a second
  synchronisation), and ``changed()``: which tensors (read only for a flagged region).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import types
import weakref
from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree

from fixes.recompute import state as recompute_state
from fixes.sanitize import _dictversion, _intended
from fixes.sanitize import _fingerprint as fp
from fixes.sanitize._ran import by_value

__all__ = ["REWALK_ROUNDS", "SMALL_STATE_BYTES", "Reached", "State", "Walks", "any_changed",
           "changed_flags", "narrowed", "reached", "roots_of", "tensor_name"]

SMALL_STATE_BYTES = 1 << 16  # reached non-parameter tensors up to this size: compared by value
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
# attribute values walked no further (a module's own walk reaches its submodules)
_ATOMIC = (torch.nn.Module, type, str, bytes, int, float)
# what is no plain object or dict (a rescan reads the whole of it)
_NOT_PLAIN = (torch.Tensor, *_ATOMIC, list, tuple)
_WIDE = 64  # a container's first items walked
# a tuple, not a set: a class whose metaclass defines __eq__ without __hash__ is unhashable
_NOTHING = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)
REWALK_ROUNDS = 16  # a kept walk's most rounds (see the module docstring)
_VERSION = operator.attrgetter("_version")
_CALL = operator.call  # a weak reference's referent, in map: no Python call per reference
_SLOT_STORAGES = 8  # per argument slot, the storages kept (weakly) that are still alive


def _storage_kept() -> bool:
    """Whether torch keeps one Python object per storage while the storage lives (a weak
    reference to it then says when the storage is freed: ``Walks._rebound_arguments``)."""
    t = torch.zeros(1)
    ref = weakref.ref(t.untyped_storage())
    return ref() is not None and ref() is t.untyped_storage()


_STORAGE_KEPT = _storage_kept()
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
_DATA_PTR = operator.methodcaller("data_ptr")


def _skipped(name: str, value) -> bool:
    """An attribute a walk does not go into: nothing to find there (most of a module's)."""
    return value is None or isinstance(value, _ATOMIC) or name.startswith("_")


def reached(roots, ran=None) -> list[torch.Tensor]:
    """The plain tensors reachable from ``roots``, narrowed to the modules ``ran`` (see the
    module docstring)."""
    tensors, modules = _roots(roots)
    whole, own = narrowed(modules, ran, _tree)
    for _, found, _ in _walk(list(whole.values()), list(own.values())):
        for t in found:
            tensors.setdefault(id(t), t)
    return list(tensors.values())


def _tree(module: torch.nn.Module) -> tuple[set[int], dict[int, torch.nn.Module]]:
    """The ids of ``module`` and its submodules, and each submodule's parent (by id)."""
    ids, parents, stack = {id(module)}, {}, [module]
    while stack:
        m = stack.pop()
        for child in m._modules.values():
            if child is not None and id(child) not in ids:
                ids.add(id(child))
                parents[id(child)] = m
                stack.append(child)
    return ids, parents


def narrowed(modules: dict[int, torch.nn.Module], ran, tree,
             ) -> tuple[dict[int, torch.nn.Module], dict[int, torch.nn.Module]]:
    """A region's ``modules`` (from ``_roots``) narrowed to those of them its forward ran
    (``ran``: ``_ran.ModulesRun``'s record, first call first): ``(walked whole, read alone)``.
    A module that ran, or none of whose submodules ran (a function reading its parameters
    without calling it), is walked whole; in one some of whose submodules ran (megatron's
    block, in each layer's region's closure) the outermost of those are walked whole, and it
    and every module between it and them are read alone -- their own parameters, buffers and
    tensor attributes (a layer whose ``forward`` is called directly, not through ``__call__``,
    is not recorded: its own state is still reached). ``tree(module)``: ``_tree``'s answer."""
    if not ran:
        return modules, {}
    ids = list(map(id, ran))  # each module once (``_ran``)
    called = set(ids)
    whole: dict[int, torch.nn.Module] = {}
    own: dict[int, torch.nn.Module] = {}
    for i, module in modules.items():
        if i in called:
            whole.setdefault(i, module)
            continue
        inside, parents = tree(module)
        tops: list[tuple[int, torch.nn.Module]] = []
        covered: list[set[int]] = []  # the tops' subtrees
        for j, m in zip(ids, ran, strict=True):  # an ancestor is called before its submodules
            if j in inside:
                for c in covered:
                    if j in c:
                        break
                else:
                    tops.append((j, m))
                    covered.append(tree(m)[0])
        if not tops:
            whole.setdefault(i, module)
            continue
        own[i] = module
        for j, m in tops:
            whole.setdefault(j, m)
            parent = parents.get(j)
            while parent is not None and parent is not module:  # the modules in between
                own.setdefault(id(parent), parent)
                parent = parents.get(id(parent))
    for i in whole:
        own.pop(i, None)  # walked whole as another root's submodule
    return whole, own


class Reached:
    """The tensors a region reaches, split as ``State`` reads them: ``small`` (non-parameter
    tensors up to ``SMALL_STATE_BYTES``: compared by their bits, where still readable) and
    ``versioned`` (every other strided one: compared by version counter)."""

    __slots__ = ("small", "versioned")

    def __init__(self, small: list[torch.Tensor], versioned: list[torch.Tensor]):
        self.small, self.versioned = small, versioned

    @classmethod
    def of(cls, tensors) -> Reached:
        small, versioned = [], []
        for t in tensors:
            # numel * element_size, not nbytes: a sparse tensor has no nbytes
            if type(t) is not torch.nn.Parameter and t.numel() * t.element_size() \
                    <= SMALL_STATE_BYTES:
                small.append(t)
            elif t.layout is torch.strided and not t.is_meta:
                versioned.append(t)
        return cls(small, versioned)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return itertools.chain(self.small, self.versioned)


class _Kept:
    """One kept walk of a set of modules: per (sub)module walked, the tensors found in it
    (weakly) and the attributes they were found under; the walk's round and the registrations
    seen before it. Its parameters (strided, not meta, when found: the bulk of it) are kept
    as compared by counter; every other tensor found is sorted anew at each read (a buffer
    resized or swapped since, a parameter materialised from meta, is read as it is now). A
    found tensor's death marks its module (a weak reference's callback) for a rescan of that
    module alone. A module scanned again is read apart from the others from then on
    (``volatile``): megatron's token dispatcher rebinds its routing tensors every forward, and
    joining the whole walk's lists again for it was most of a region's read. ``fresh`` (values
    "all"): the walk's ``_shape`` is kept, for ``check``."""

    __slots__ = ("refs", "entries", "round", "checked", "registered", "dead", "volatile",
                 "params", "others", "ids", "apart", "rescanned", "shaped", "rebound",
                 "__weakref__")

    def __init__(self, modules, walked, round_: int, registered: int, fresh: bool):
        self.refs = [weakref.ref(m) for m in modules]
        self.round = self.checked = round_  # the walk's round; the last round it was checked
        self.registered = registered
        self.dead: set[int] = set()  # entries a found tensor of which was freed
        self.volatile: set[int] = set()  # entries scanned again since the walk: read apart
        self.apart: set[int] = set()  # the ids of the tensors read apart by the last read
        self.rescanned = 0  # modules scanned again by ``check`` (``Walks.rescanned`` reads it)
        # the ids of the tensors a rescan since the last read found and the entry's scan before
        # it did not hold alive (``_replace``): rebound values, compared by counter (``read``)
        self.rebound: set[int] = set()
        self.shaped = fresh  # ``_shape`` kept: ``check`` can answer
        seen: set[int] = set()
        self.entries = [self._entry(i, sub, ts, names, _shape(sub, seen) if fresh else None)
                        for i, (sub, ts, names) in enumerate(walked)]
        self._join()

    def _entry(self, i: int, sub, tensors, names, shape) -> list:
        mark = functools.partial(_mark_dead, weakref.ref(self), i)
        params, others = [], []
        for t in tensors:
            (params if _counted(t) else others).append(weakref.ref(t, mark))
        return [weakref.ref(sub), params, others, names, shape]

    def _join(self) -> None:
        """The tensors of the entries never scanned again, in two flat lists (read in one pass
        each); their ids, once asked (``known``)."""
        stable = [e for i, e in enumerate(self.entries) if i not in self.volatile]
        self.params = _once(itertools.chain.from_iterable(e[1] for e in stable))
        self.others = _once(itertools.chain.from_iterable(e[2] for e in stable))
        self.ids = None
        self.apart = set()

    def _replace(self, i: int, entry: list) -> bool:
        """Entry ``i`` scanned again; True where the flat lists must be joined again (it was
        in them)."""
        before = {id(t) for t in map(_CALL, itertools.chain(self.entries[i][1],
                                                            self.entries[i][2]))
                  if t is not None}  # alive: a freed tensor's id may be a new one's
        self.rebound.update(id(t) for t in map(_CALL, itertools.chain(entry[1], entry[2]))
                            if t is not None and id(t) not in before)
        self.entries[i] = entry
        self.dead.discard(i)
        if i in self.volatile:
            return False
        self.volatile.add(i)
        return True

    def holds(self, modules: list, fresh: bool, round_: int, registered: int) -> bool:
        return (registered == self.registered and round_ - self.round < REWALK_ROUNDS
                and all(r() is m for r, m in zip(self.refs, modules, strict=True))
                and (not fresh or self.checked == round_
                     or (self.shaped and self.check(round_))))

    def check(self, round_: int) -> bool:
        """Whether a fresh walk would find what this one did, found without walking: each
        (sub)module's attributes and the members of every object the walk went into compared
        with the walk's (``_shape``) -- by their dicts' version tags where the interpreter has
        them (``_dictversion``: a module whose ``__dict__`` kept its tag holds what it held;
        one number a module, where comparing every attribute by identity was most of
        ``values="all"``'s reach on the GPU hosts), else by identity; where some differ, those
        attributes alone are scanned again (megatron's token dispatcher, a plain object of its
        MoE layer, rebinds its routing tensors every forward; the config beside it is not read
        again). False (walk anew) where a module is gone, or one let go of an object it was
        the walk's way into (another module holding it was never walked into it)."""
        subs = [entry[0]() for entry in self.entries]
        if any(sub is None for sub in subs):
            return False
        changes = None
        if _dictversion.tag is not None and all(e[4][3] is not None for e in self.entries):
            try:
                changes = self._retagged(subs)
            except Exception:  # a module's __dict__ swapped for another type, an audit hook
                changes = None  # refusing ctypes: compared by identity
        if changes is None:
            changes = [_changed(sub, entry[4]) for sub, entry in zip(subs, self.entries,
                                                                     strict=True)]
        if any(changes):
            seen = {i for entry, names in zip(self.entries, changes, strict=True)
                    for c in entry[4][2] if c[0] not in names for i in _ids_into(c)}
            join = False
            for i, names in enumerate(changes):
                if names:
                    rescanned = self._rescan(i, names, seen)
                    if rescanned is None:
                        return False
                    join |= rescanned
            if join:
                self._join()
        self.checked = round_
        return True

    def _retagged(self, subs: list[torch.nn.Module]) -> list[set[str]] | None:
        """``check``'s changes from the tags (``_tags``), one pass over the modules: a module
        whose ``__dict__`` kept its tag since the walk holds the same attributes bound to the
        same objects, so only the objects the walk went into are read (``_gone_into``), and
        only a module whose tag moved is compared attribute by attribute (``_changed``)."""
        attributes = list(map(vars, subs))
        if not all(type(a) is dict for a in attributes):
            return None
        now = _dictversion.tags(attributes)
        changes: list[set[str]] = []
        for sub, entry, fields, t in zip(subs, self.entries, attributes, now, strict=True):
            shape = entry[4]
            if t != shape[3][0]:
                changes.append(_changed(sub, shape))
            elif shape[2]:
                changes.append(_gone_into(fields, shape))
            else:
                changes.append(set())
        return changes

    def _rescan(self, i: int, names: set[str], seen: set[int]) -> bool | None:
        """Entry ``i`` with its attributes ``names`` scanned again, whole (the others where
        the walk found tensors under them); None where it let go of an object it was the
        walk's way into, else whether the flat lists must be joined again."""
        sub, shape = self.entries[i][0](), self.entries[i][4]
        kept = tuple(c for c in shape[2] if c[0] not in names)
        into = kept + _into(sub, set(seen), names)
        if not {c[1] for c in shape[2]} <= {c[1] for c in into}:
            return None
        held = dict(self.entries[i][3])
        attributes = sub.__dict__
        for name in names:
            if name.startswith("_"):
                continue
            value = attributes.get(name)
            if _skipped(name, value):
                held.pop(name, None)  # nothing there now
            else:
                held[name] = None  # read whole
        scan = _Scan()  # what other entries went into is theirs; this one's own is read
        scan.seen.update(seen.difference(i for c in kept for i in _ids_into(c)))
        tensors, found = scan.module(sub, tuple(held.items()))
        shape = _made_shape(sub, into)
        self.rescanned += 1
        return self._replace(i, self._entry(i, sub, tensors, found, shape))

    def read(self) -> tuple[Reached | None, int]:
        """The kept tensors and how many modules were scanned again; None where a module gone
        or a tensor freed unmarked makes a fresh walk the answer. A module whose tensor died is
        scanned again, alone, in the attributes the walk found tensors under (megatron's token
        dispatcher rebinds its routing state each forward; a tensor under another attribute is
        a new plain attribute: the next fresh walk's)."""
        rescanned = 0
        if self.dead:
            dead, self.dead = self.dead, set()
            scan, join = _Scan(), False
            for i in sorted(dead):
                sub = self.entries[i][0]()
                if sub is None:
                    return None, rescanned
                tensors, _ = scan.module(sub, self.entries[i][3])
                join |= self._replace(i, self._entry(i, sub, tensors, *self.entries[i][3:]))
                rescanned += 1
            if join:
                self._join()
        params = list(map(_CALL, self.params))
        others = list(map(_CALL, self.others))
        if self.volatile:  # read apart; a tensor of theirs may be another module's too (tied
            known = self.known(params, others)  # weights): found once
            extra = {}  # id -> (tensor, compared by counter)
            rebound, self.rebound = self.rebound, set()
            for i in self.volatile:
                for t in map(_CALL, itertools.chain(self.entries[i][1], self.entries[i][2])):
                    if t is None or id(t) not in known:
                        extra.setdefault(id(t), (t, t is not None and (
                            _counted(t) or (id(t) in rebound and _by_counter(t)))))
            self.apart = set(extra)
            for t, counted in extra.values():
                (params if counted else others).append(t)
        # a tensor freed since the marks were read (a callback on another thread): walk anew
        if any(map(operator.is_, itertools.chain(params, others), itertools.repeat(None))):
            return None, rescanned
        found = Reached.of(others)
        found.versioned += params
        return found, rescanned

    def known(self, params=None, others=None) -> set[int]:
        """The ids of the tensors in the flat lists (found from ``params`` and ``others``,
        their referents, where given)."""
        if self.ids is None:
            if params is None:
                params, others = map(_CALL, self.params), map(_CALL, self.others)
            self.ids = set(map(id, itertools.chain(params, others)))
        return self.ids


def _counted(t: torch.Tensor) -> bool:
    """A kept walk's tensor compared by counter without sorting it again at each read: a
    strided parameter with storage (not meta)."""
    return type(t) is torch.nn.Parameter and t.layout is torch.strided and not t.is_meta


def _by_counter(t: torch.Tensor) -> bool:
    """A rebound value (``_Kept.rebound``: a tensor a rescan found that the module's scan before
    it did not hold) compared by counter, not by its bits, where it has one: strided, with
    storage, not an inference tensor (which has no counter). Why: megatron's token dispatcher
    rebinds its routing map, probs and indices every forward; snapshotting their bits at each
    recompute's start and end, and comparing them at the backward's end, was most of what a
    MoE region's ``values="none"`` cost beyond a GPT region's on the H200
    (``benchmarks.sanitizer_host_time``). A tensor that stays (a module's buffer or plain
    statistics, another module's buffer held here, a mask written with the same values) keeps
    its bits compared. What this gives up: a write that bypasses the counter (``.data``, a
    kernel's unannounced output such as functional batch norm's statistics) into a value
    rebound since the module's last scan."""
    return t.layout is torch.strided and not t.is_meta and not t.is_inference()


def _once(refs) -> list:
    """Weak references less those to a referent an earlier one has (a tensor several modules
    hold is in each one's entry)."""
    seen: set[int] = set()
    return [r for r in refs if (i := id(r())) not in seen and not seen.add(i)]


def _mark_dead(kept_ref, i: int, _ref) -> None:
    kept = kept_ref()
    if kept is not None:
        kept.dead.add(i)


class Walks:
    """The walks of modules, kept per set of modules (see the module docstring): the regions
    that reach the same modules (a layer's, round after round) share one walk, for as long
    as it holds."""

    def __init__(self):
        self._kept: dict[tuple, _Kept] = {}  # module ids (whole, alone) -> their kept walk
        # module id -> (it, registered, the round it was read, ``_tree``'s answer)
        self._trees: dict[int, tuple] = {}
        self._round = 0
        self._registered = 0  # parameters, buffers and modules registered while watching
        self._hooks: list | None = None
        # region identity (call site, position, ``_ran.identity``) -> [the modules its forward
        # ran, weakly; the round recorded; registrations then; its ``_Plan`` or None]
        self._ran: dict[tuple, list] = {}
        # region identity -> (the round last read, per argument slot the storages of the
        # small tensor arguments it was passed, weakly, the last one last):
        # ``_rebound_arguments``
        self._arguments: dict[tuple, tuple[int, dict[int, list[weakref.ref]]]] = {}
        self.walked = 0  # fresh walks done
        self.rescanned = 0  # modules scanned again: a tensor found in them was freed
        self.recorded = 0  # records kept (``keep_ran``; in ``all``, those a plan was made from)

    def new_round(self) -> None:
        self._round += 1
        if self._round % REWALK_ROUNDS == 0:  # let go of what can no longer hold
            self._kept = {k: kept for k, kept in self._kept.items()
                          if self._round - kept.round < REWALK_ROUNDS}
            self._trees = {k: kept for k, kept in self._trees.items()
                           if self._round - kept[2] < REWALK_ROUNDS}
            self._ran = {k: kept for k, kept in self._ran.items()
                         if self._round - kept[1] < REWALK_ROUNDS}
            self._arguments = {k: kept for k, kept in self._arguments.items()
                               if self._round - kept[0] < REWALK_ROUNDS}

    def ran(self, key: tuple) -> list[weakref.ref] | None:
        """The modules the forward of the region ``key`` (its identity) ran when last recorded
        -- fewer than ``REWALK_ROUNDS`` rounds ago, with no parameter, buffer or module
        registered since -- or None: record them. Why: recording puts every module call of a
        region's forward on torch's slow path (a global hook, ``_ran``): on megatron's MoE that
        was a third of ``values="none"``'s Python calls a region."""
        kept = self._ran.get(key)
        if kept is None or kept[2] != self._registered or self._round - kept[1] >= REWALK_ROUNDS:
            return None
        return kept[0]

    def keep_ran(self, key: tuple, refs: list[weakref.ref]) -> None:
        self._ran[key] = [refs, self._round, self._registered, None]  # its ``_Plan``: reach's
        self.recorded += 1

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Counts every parameter, buffer and submodule registered in the process (torch's
        global registration hooks) while entered: each makes the kept walks fresh."""
        if self._hooks is not None:
            raise RuntimeError("Walks.watching: already watching")

        def registered(*_):
            self._registered += 1  # returns None: the registered value is left as it is

        nn_module = torch.nn.modules.module
        self._hooks = [register(registered) for register in (
            nn_module.register_module_parameter_registration_hook,
            nn_module.register_module_buffer_registration_hook,
            nn_module.register_module_module_registration_hook)]
        try:
            yield
        finally:
            hooks, self._hooks = self._hooks, None
            for handle in hooks:
                handle.remove()

    def _tree(self, module: torch.nn.Module, fresh: bool) -> tuple:
        """``_tree(module)``, kept while no module was registered, for fewer than
        ``REWALK_ROUNDS`` rounds (a submodule deleted, which no hook sees, is seen by then),
        and read anew once a round where ``fresh``."""
        kept = self._trees.get(id(module))
        if (kept is None or kept[0]() is not module or kept[1] != self._registered
                or self._round - kept[2] >= (1 if fresh else REWALK_ROUNDS)):
            kept = self._trees[id(module)] = (weakref.ref(module), self._registered,
                                              self._round, _tree(module))
        return kept[3]

    def _planned(self, key, recorded, roots, fresh: bool) -> tuple | None:
        """(tensors, walk key, modules listed) of ``roots`` from the plan of region ``key``
        made with the record ``recorded`` (``_Plan``) -- ``fresh`` (``values="all"``, whose
        forwards each record): with a record of the same modules, those of either still
        alive compared in order by identity (a module made and dropped by each forward,
        megatron's softmax, is in neither by then) -- or None: none, or something in it
        freed."""
        entry = self._ran.get(key)
        if entry is None or not isinstance(entry[3], _Plan):
            return None
        if entry[0] is not recorded and not (
                fresh and recorded is not None and (kept := self.ran(key)) is not None
                and _same_alive(kept, recorded)):
            return None
        plan = entry[3]
        listed = list(map(_CALL, plan.listed))
        found = list(map(_CALL, plan.tensors))
        if any(map(operator.is_, itertools.chain(listed, found), itertools.repeat(None))):
            return None
        tensors = dict(zip(map(id, found), found, strict=True))
        for t in itertools.islice(roots, 1, None):  # plain tensors (``_plannable``)
            tensors.setdefault(id(t), t)
        return tensors, plan.walk_key, listed

    def reach(self, roots, fresh: bool, ran=None, key: tuple | None = None,
              recorded: list | None = None) -> Reached:
        """What ``roots`` reach, narrowed to the modules ``ran`` (``narrowed``; a list, or a
        function returning it, called where needed): their own tensors, and their modules'
        from the kept walk (a fresh one where it no longer holds). ``key``, a region's
        identity whose forward's record of the modules it ran is ``recorded`` (``ran``):
        where its function (``roots[0]``) has a plan made with that record and the other
        roots are plain tensors, what the function reaches is the plan's (``_Plan``; with
        ``fresh``, the plan of the identity's last record where it lists the same live
        modules, else a plan made now from ``recorded``)."""
        planned = None
        plannable = key is not None and _plannable(roots)
        if plannable:
            planned = self._planned(key, recorded, roots, fresh)
        if planned is not None:
            tensors, walk_key, listed = planned
            whole_modules, alone_modules = (listed[:len(walk_key[0])],
                                            listed[len(walk_key[0]):])
        else:
            tensors, modules = _roots(roots)
            whole, alone = narrowed(modules, ran() if callable(ran) else ran,
                                    lambda m: self._tree(m, fresh))
            if fresh and plannable and recorded is not None:  # ``all``: this record's plan
                self.keep_ran(key, recorded)
            if plannable and (entry := self._ran.get(key)) is not None \
                    and entry[0] is recorded and entry[3] is None:
                mutable = [False]
                found_through = _roots(roots[:1], mutable)[0]
                entry[3] = _UNPLANNED if mutable[0] else _Plan(found_through, whole, alone)
            walk_key = (tuple(whole), tuple(alone))
            whole_modules, alone_modules = list(whole.values()), list(alone.values())
            listed = [*whole_modules, *alone_modules]
        kept = self._kept.get(walk_key)
        found = None
        if kept is not None and kept.holds(listed, fresh, self._round, self._registered):
            found, rescanned = kept.read()
            self.rescanned += rescanned + kept.rescanned
            kept.rescanned = 0
        if found is None:  # a fresh walk answers from itself: nothing of it to read back
            walked = _walk(whole_modules, alone_modules)
            kept = self._kept[walk_key] = _Kept(listed, walked, self._round,
                                                self._registered, fresh)
            self.walked += 1
            found = Reached.of(list({id(t): t for _, ts, _ in walked for t in ts}.values()))
        if tensors:  # the region's own tensors (its inputs), less those the walk found
            known = kept.known()
            own = Reached.of([t for i, t in tensors.items()
                              if i not in known and i not in kept.apart])
            if own.small and key is not None:
                self._rebound_arguments(key, roots, own)
            found.small += own.small
            found.versioned += own.versioned
        return found

    def _rebound_arguments(self, key: tuple, roots, own: Reached) -> None:
        """The small tensors among a region's arguments (``roots[1:]``) made anew for each call
        moved from ``own.small`` to ``own.versioned``: compared by counter (``_by_counter``), as
        a module's rebound values are (``_Kept.rebound``). Megatron makes its attention's mask
        type a new one-element tensor each call; snapshotting its bits at each recompute's
        start and end and comparing them at the backward's end was half of a region's
        ``values="none"`` host time on its selective recompute.

        Made anew is told by storage, per argument slot of the region identity: an argument
        goes to the counter where the storage the slot last held has been freed and its own
        was not seen in the slot before (the mask: each call's storage gone by the next
        step's backward). One whose storage the slot held before, or beside a storage still
        alive -- a buffer handed to the function, a view or ``detach()`` of one made per call
        (a review of the first version, which told arguments by tensor object: stacked
        statistics passed as ``stats[i]`` were then written twice unseen), other layers'
        buffers at a slot whose layers change from step to step -- keeps its bits compared,
        as does every argument of a slot's first region, and all of them where torch does not
        keep one Python object per storage (``_STORAGE_KEPT``). What this gives up: a write
        that bypasses the counter (``.data``, a kernel's unannounced output) into a small
        argument made anew for each call."""
        if not _STORAGE_KEPT:
            return
        small = {id(t) for t in own.small}
        now: dict[int, tuple[torch.Tensor, object]] = {}
        for i, t in enumerate(itertools.islice(roots, 1, None)):
            if id(t) in small and _by_counter(t):
                try:
                    now[i] = (t, t.untyped_storage())
                except (RuntimeError, NotImplementedError, TypeError):  # a subclass's own
                    continue
        if not now:
            return
        entry = self._arguments.get(key)
        slots: dict[int, list[weakref.ref]] = entry[1] if entry is not None else {}
        self._arguments[key] = (self._round, slots)
        rebound: set[int] = set()
        for i, (t, storage) in now.items():
            seen = slots.get(i)
            if seen is None:  # the slot's first region: its bits
                slots[i] = [weakref.ref(storage)]
                continue
            alive = [s for s in map(_CALL, seen) if s is not None]
            if not any(s is storage for s in alive):
                if seen[-1]() is None:  # the last one freed: made anew for each call
                    rebound.add(id(t))
                # kept as the slot's last; at most ``_SLOT_STORAGES`` alive ones before it
                slots[i] = [*map(weakref.ref, alive[-(_SLOT_STORAGES - 1):]),
                            weakref.ref(storage)]
            elif len(alive) < len(seen):  # let go of the freed ones
                slots[i] = [weakref.ref(s) for s in alive]
        if rebound:
            own.versioned += [t for t in own.small if id(t) in rebound]
            own.small = [t for t in own.small if id(t) not in rebound]

    def reached(self, roots, fresh: bool, ran=None) -> list[torch.Tensor]:
        return list(self.reach(roots, fresh, ran))


_STORAGE_BYTES = operator.methodcaller("nbytes")
_SIGNATURE = (_DATA_PTR, operator.methodcaller("stride"),
              operator.methodcaller("storage_offset"), _SHAPE_DTYPE)


def _signatures(tensors: list[torch.Tensor]) -> list[tuple] | None:
    """Each tensor's (data pointer, strides, offset, (shape, dtype), its storage's bytes),
    read with no Python call per tensor. Equal to when a byte view of a readable tensor
    (``fp.readable``) was made: it is still readable and the view reads its bytes (a tensor
    given another storage, or one released by ``resize_(0)``, has another data pointer; a
    storage regrown smaller, other bytes). None for a tensor with no strides (sparse)."""
    try:
        storages = map(_STORAGE_BYTES, map(torch.Tensor.untyped_storage, tensors))
        return list(zip(*(map(f, tensors) for f in _SIGNATURE), storages, strict=True))
    except (RuntimeError, NotImplementedError):
        return None


def _fits(t: torch.Tensor, signature: tuple) -> bool:
    """``fp.readable(t)`` from its signature (``_signatures``), with no call into torch: a plain
    tensor with memory (a meta tensor's storage, and a released one, has a null base: its
    data pointer is its offset's bytes -- a meta view at an offset read as readable raised
    out of the backward's flush, a review of c7bca23), elements, and a storage holding every
    one of them."""
    pointer, strides, offset, (shape, dtype), nbytes = signature
    if pointer == offset * dtype.itemsize or type(t) not in _PLAIN_TYPES:
        return False  # no memory: the storage's base pointer is null
    if 0 in shape:
        return False
    return fp.extent(shape, strides, offset) * dtype.itemsize <= nbytes


_UNPLANNED = False  # a record's plan slot where the function reaches through something mutable


class _Plan:
    """What a region identity's function reaches, made once per record of the modules its
    forward ran (``Walks.ran``): the plain tensors found through it (``_roots``: its closure
    and defaults), and its modules narrowed to those the forward ran -- the kept walk's key
    and modules. Taken as its own by every region of that identity while the record holds
    (found through its closure each region, with the narrowing, it was a fifth of
    ``values="none"``'s Python calls a region on megatron's MoE); in ``values="all"``, whose
    forwards each record, by every region whose record lists the same modules still alive, in
    order (``_same_alive``; megatron's softmax module, made and dropped by each forward, is in
    none by then): the walk of the closure and the narrowing were a quarter of ``all``'s
    reach on the H200's host. What ``all`` gives up there: a module taken out of the tree
    where no hook sees it (``del parent.child``) while the forward still runs it leaves the
    narrowing as the plan made it until the identity's forward runs other modules or the
    plan is ``REWALK_ROUNDS`` rounds old (a module put in or taken out that changes what runs
    makes a new plan at once). Made only for a function
    that reaches them through nothing that can hold other objects while it stays the same
    object (a list, dict or partial, a nested function, a global: ``_roots``'s ``mutable``):
    the identity reads the function's own cells and defaults, so it changes where they do;
    through a list changed in place, a planned function kept reaching the module taken out
    (a review of 628638c). Held weakly."""

    __slots__ = ("tensors", "listed", "walk_key")

    def __init__(self, tensors: dict, whole: dict, alone: dict):
        self.tensors = [weakref.ref(t) for t in tensors.values()]
        self.listed = [weakref.ref(m) for m in itertools.chain(whole.values(), alone.values())]
        self.walk_key = (tuple(whole), tuple(alone))


def _same_alive(kept: list[weakref.ref], recorded: list[weakref.ref]) -> bool:
    """Whether two records of the modules run list the same ones still alive, in order."""
    a = [m for m in map(_CALL, kept) if m is not None]
    b = [m for m in map(_CALL, recorded) if m is not None]
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _plannable(roots) -> bool:
    """A region whose roots besides its function are plain tensors (its arguments): what the
    function reaches can be planned (``_Plan``); a module argument is narrowed each time."""
    return set(map(type, itertools.islice(roots, 1, None))) <= _PLAIN_TYPES


def tensor_name(t: torch.Tensor, roots) -> str | None:
    """Where ``t`` sits among what ``roots`` reach (a finding's message; not on a hot path):
    its path from the outermost module holding it -- ``Block.layers.0.calls`` for a
    parameter, buffer or tensor attribute, one level into a plain object or dict an attribute
    holds (megatron's token dispatcher) -- or "the region's argument"; None where not found."""
    tensors, modules = _roots(roots)
    inner = {id(sub) for m in modules.values() for sub in itertools.islice(m.modules(), 1, None)}
    for root in (m for i, m in modules.items() if i not in inner):
        for prefix, sub in root.named_modules(remove_duplicate=False):
            path = ".".join(filter(None, (type(root).__name__, prefix)))
            for name, value in itertools.chain(sub._parameters.items(), sub._buffers.items(),
                                               sub.__dict__.items()):
                if value is t:
                    return f"{path}.{name}"
                fields = None if isinstance(value, torch.Tensor) else _fields(value)
                for key, x in (list(fields.items())[:_WIDE] if fields is not None else ()):
                    if x is t:
                        return f"{path}.{name}.{key}"
    return "the region's argument" if id(t) in tensors else None


def _tensor(tensors: dict, t: torch.Tensor) -> None:
    if type(t) in _PLAIN:
        tensors.setdefault(id(t), t)


def _roots(roots, mutable: list | None = None,
           ) -> tuple[dict[int, torch.Tensor], dict[int, torch.nn.Module]]:
    """The tensors and modules among ``roots``, their closures, partials and containers.
    ``mutable``: a list, set to ``[True]`` where what was found came through something that
    can hold other objects later while it stays the same object -- a list, dict or partial,
    a nested function's closure (its cells can be rebound), a global -- so finding it again
    can find other things (``_Plan`` is made only where nothing did)."""
    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()  # containers and callables walked already
    tensor = functools.partial(_tensor, tensors)

    def visit(obj, depth: int) -> None:
        kind = type(obj)
        if kind in _PLAIN:
            tensors.setdefault(id(obj), obj)
        elif kind in _NOTHING:  # most closure cells and arguments: nothing under them
            return
        elif isinstance(obj, torch.Tensor):
            tensor(obj)
        elif isinstance(obj, torch.nn.Module):
            modules.setdefault(id(obj), obj)
        elif depth > 2 or id(obj) in seen:
            return
        elif isinstance(obj, (list, tuple)):
            if mutable is not None and kind is not tuple:
                mutable[:] = [True]
            seen.add(id(obj))
            for x in obj[:_WIDE]:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            if mutable is not None:
                mutable[:] = [True]
            seen.add(id(obj))
            for x in list(obj.values())[:_WIDE]:
                visit(x, depth + 1)
        elif isinstance(obj, functools.partial):
            if mutable is not None:
                mutable[:] = [True]
            seen.add(id(obj))
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif callable(obj):
            if mutable is not None and depth > 0:
                mutable[:] = [True]
            seen.add(id(obj))
            visit(getattr(obj, "__self__", None), depth + 1)
            # the region's function: its identity (``_ran.identity``) holds each closure cell
            # and default that is a small container of plain values by its value -- nothing
            # under it to reach, and another value is another identity, so it is no mutable
            # path to a plan (megatron-core 0.19's attention closes over a new ``{}`` and
            # ``[]`` each call)
            pinned = depth == 0 and type(obj) is types.FunctionType
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if not (pinned and by_value(contents)):
                    visit(contents, depth + 1)
            # ``def f(h, layer=layer)``: a loop's layer bound by a default argument
            defaults = getattr(obj, "__defaults__", None)
            if defaults and pinned:
                for value in defaults:
                    if not by_value(value):
                        visit(value, depth + 2)  # where the tuple's items are visited
            elif defaults:
                visit(defaults, depth + 1)
            kwdefaults = getattr(obj, "__kwdefaults__", None)
            if kwdefaults:
                visit(kwdefaults, depth + 1)
            code, names = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
            if code is not None and isinstance(names, dict):  # the globals it names
                for name in code.co_names:
                    value = names.get(name)
                    if isinstance(value, (torch.Tensor, torch.nn.Module, dict, list)):
                        if mutable is not None:
                            mutable[:] = [True]
                        visit(value, depth + 1)

    for root in roots:
        visit(root, 0)
    # ``visit`` calls itself through its closure: a reference cycle holding every tensor the
    # region reaches (its input: a chunk view the reclaim let go of kept its storage) until
    # the cycle collector runs. Broken here.
    visit = None
    return tensors, modules


class _Scan:
    """One pass over modules' own tensors: each container and plain object visited once
    (``seen``); each tensor found once per module that holds it (``_mine``). A tensor two
    modules hold is each one's: credited to the first alone, it was lost when that one rebound
    its attribute (scanned again alone) while the other still held it, until the next fresh
    walk."""

    def __init__(self):
        self.seen: set[int] = set()
        self._mine: dict[int, torch.Tensor] = {}  # the module's tensors, in the order found
        # tensors met, counted again under each attribute: one under two attributes of a
        # module is found under both (a rescan of one rebound leaves it reached by the other)
        self._met = 0

    def _add(self, t: torch.Tensor) -> None:
        if type(t) in _PLAIN:
            self._met += 1
            self._mine.setdefault(id(t), t)

    def _attribute(self, value, depth: int) -> None:
        """Tensors held in a module's attributes: directly, or in a dict, list or plain
        object they hold (TransformerEngine's ``fp8_meta``), two levels deep."""
        if isinstance(value, torch.Tensor):
            self._add(value)
        elif depth >= 2 or isinstance(value, _ATOMIC):
            return
        elif id(value) in self.seen:
            return
        elif isinstance(value, dict):
            self.seen.add(id(value))
            for x in list(value.values())[:_WIDE]:
                self._attribute(x, depth + 1)
        elif isinstance(value, (list, tuple)):
            self.seen.add(id(value))
            for x in value[:_WIDE]:
                self._attribute(x, depth + 1)
        elif not callable(value) and isinstance(getattr(value, "__dict__", None), dict):
            self.seen.add(id(value))
            for x in list(vars(value).values())[:_WIDE]:
                self._attribute(x, depth + 1)

    def _held(self, value, fields: dict) -> tuple:
        """Scan a module attribute's ``value``, a plain object or dict not seen before, whose
        ``fields`` are its ``__dict__`` or itself: the keys of those that held a new tensor (a
        rescan reads only those)."""
        items = list(fields.items())
        self.seen.add(id(value))
        keys = []
        for key, x in items[:_WIDE]:
            before = self._met
            self._attribute(x, 1)
            if self._met > before:
                keys.append(key)
        return tuple(keys)

    def _again(self, value, keys: tuple | None) -> None:
        """A rescan of an attribute: only ``keys`` of a plain object or dict (a tensor under
        another field is a new one: seen by the next fresh walk), else the whole of it."""
        fields = _fields(value)
        if keys is None or fields is None or id(value) in self.seen:
            self._attribute(value, 0)
            return
        self.seen.add(id(value))
        for key in keys:
            if key in fields:
                self._attribute(fields[key], 1)

    def module(self, sub: torch.nn.Module, held: tuple | None = None,
               ) -> tuple[list[torch.Tensor], tuple]:
        """``sub``'s own parameters, buffers and tensor attributes (not its submodules'; those
        another module holds too among them), and where they were found: ``(attribute name,
        the keys of its fields that held them or None)`` each. A plain object or container
        this pass went into before is another module's way into its tensors (megatron's
        config: walked once). ``held``: only there (a rescan: megatron's modules, and its
        token dispatcher, also hold a config of hundreds of plain fields, walked again for
        nothing)."""
        self._mine = {}
        found = []
        attributes = sub.__dict__
        if held is None:
            for name, value in attributes.items():  # no parameter / buffer
                if _skipped(name, value):
                    continue
                before = self._met
                fields = None if isinstance(value, torch.Tensor) else _fields(value)
                if fields is None or id(value) in self.seen:
                    self._attribute(value, 0)
                    keys = None  # a rescan reads it whole
                else:
                    keys = self._held(value, fields)
                if self._met > before:
                    found.append((name, keys))
        else:
            for name, keys in held:
                if name in attributes:
                    self._again(attributes[name], keys)
            found = list(held)
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is not None:
                self._add(t)
        new, self._mine = list(self._mine.values()), {}
        return new, tuple(found)


def _fields(value) -> dict | None:
    """A dict itself, a plain object's ``__dict__``; None for anything else."""
    if isinstance(value, dict):
        return value
    if isinstance(value, _NOT_PLAIN) or callable(value):
        return None
    fields = getattr(value, "__dict__", None)
    return fields if isinstance(fields, dict) else None


def _members(value):
    """What the walk goes through in ``value``: a list's or tuple's items, a dict's values, a
    plain object's fields; None for anything else (a tensor, a module, an atomic value)."""
    if isinstance(value, (list, tuple)):
        return value
    fields = _fields(value)
    return None if fields is None else fields.values()


def _shape(sub: torch.nn.Module, seen: set[int]) -> tuple:
    """What a walk of ``sub`` depends on, by identity: its attributes' names and values, and
    per object among them the walk goes into (not in ``seen``: another module's way into it)
    its members, and those of the objects among its members. Equal shapes: a walk finds the
    same tensors (those it finds are held by what is compared, so no identity is reused).
    Read with them, where the interpreter has them (``_dictversion``), the version tags of
    ``sub``'s ``__dict__`` and of those objects' (``_tags``)."""
    return _made_shape(sub, _into(sub, seen))


def _made_shape(sub: torch.nn.Module, into: tuple) -> tuple:
    attributes = sub.__dict__
    ids = tuple(map(id, attributes.values()))
    return tuple(attributes), ids, into, _tags(attributes, ids, into)


def _tagged(value) -> dict | None:
    """What holds ``value``'s members where its tag says all about them: a dict itself or a
    plain object's ``__dict__``, exact dicts only (``OrderedDict.move_to_end`` reorders one
    without moving its tag, and a walk reads a container's first ``_WIDE`` members: a
    review of 6664033); else None (its members compared by identity)."""
    fields = _fields(value)
    return fields if type(fields) is dict else None


def _tag_of(value) -> int | None:
    fields = _tagged(value)
    return None if fields is None else _dictversion.tag(fields)


def _tags(attributes: dict, ids: tuple, into: tuple) -> tuple | None:
    """(the module's ``__dict__``'s tag, per ``_into`` record its object's tag, and per object
    among that one's members ``(its key where the object holding it has a tag, its tag)``) or
    None where the interpreter has no tags, or where the ids the shape holds (``ids``, and the
    records' members') are not what the module and those objects hold once the tags are read:
    a change between the two would be in the tags and in no shape (a review of 6664033). The
    key: a kept object's member is read by it, not by making a tuple of all its members
    (megatron's config has hundreds)."""
    if _dictversion.tag is None or type(attributes) is not dict:
        return None
    own = _dictversion.tag(attributes)
    outer, inner = [], []
    for name, _, _, records in into:
        value = attributes[name]
        fields = _tagged(value)
        outer.append(None if fields is None else _dictversion.tag(fields))
        members = tuple(_members(value))
        keys = list(fields) if fields is not None and records else None
        inner.append(tuple((keys[k] if keys is not None else None, _tag_of(members[k]))
                           for k, _, _ in records))
    if tuple(map(id, attributes.values())) != ids:  # the ids again, after the tags
        return None
    if any(_moved(attributes, record) for record in into):
        return None
    return own, tuple(outer), tuple(inner)


def _gone_into(attributes: dict, shape: tuple) -> set[str]:
    """The attributes (of a module whose ``__dict__`` kept its tag) through which the walk
    went into an object that no longer holds what it held: by the object's tag (``_tags``), a
    list or tuple by its members' identities; and so for the objects among its members (read
    by key from an object whose tag held: its members are the walk's)."""
    _, outer, inner = shape[3]
    names: set[str] = set()
    for (name, _, ids, records), was, inner_was in zip(shape[2], outer, inner, strict=True):
        value = attributes[name]
        if was is not None:
            fields = _tagged(value)
            if fields is None or _dictversion.tag(fields) != was:
                names.add(name)
                continue
            members = None
        else:
            members = tuple(_members(value))
            if tuple(map(id, members)) != ids:
                names.add(name)
                continue
        for (k, _, inner_ids), (key, t) in zip(records, inner_was, strict=True):
            x = members[k] if members is not None else dict.__getitem__(fields, key)
            if (_tag_of(x) != t) if t is not None else (
                    tuple(map(id, _members(x))) != inner_ids):
                names.add(name)
                break
    return names


def _into(sub: torch.nn.Module, seen: set[int], names=None) -> tuple:
    """``_shape``'s objects the walk goes into, from ``sub``'s attributes (``names`` only,
    where given): ``(name, id, its members' ids, ((position, id, members' ids) of the objects
    among its members, ...))`` each."""
    into = []
    attributes = sub.__dict__
    for name in (attributes if names is None else [n for n in attributes if n in names]):
        value = attributes[name]
        if _skipped(name, value):
            continue
        members = _members(value)
        if members is None or id(value) in seen:
            continue
        seen.add(id(value))
        members = tuple(members)
        inner = tuple((k, id(x), tuple(map(id, m))) for k, x in enumerate(members)
                      if not isinstance(x, _ATOMIC) and id(x) not in seen
                      and (m := _members(x)) is not None)
        into.append((name, id(value), tuple(map(id, members)), inner))
    return tuple(into)


def _ids_into(record: tuple) -> Iterator[int]:
    """The ids of the objects one ``_into`` record went into."""
    yield record[1]
    for _, i, _ in record[3]:
        yield i


def _changed(sub: torch.nn.Module, shape: tuple) -> set[str]:
    """The names of ``sub``'s attributes not as ``_shape`` found them: rebound, added or
    removed, or an object the walk went into through them holding other members. Empty: a
    walk of ``sub`` finds what it found (one pass, no walk)."""
    attributes = sub.__dict__
    names: set[str] = set()
    if tuple(attributes) != shape[0] or tuple(map(id, attributes.values())) != shape[1]:
        before = dict(zip(shape[0], shape[1], strict=True))
        names.update(n for n, v in attributes.items() if before.get(n) != id(v))
        names.update(n for n in before if n not in attributes)
    for record in shape[2]:
        if record[0] not in names and _moved(attributes, record):
            names.add(record[0])
    return names


def _moved(attributes: dict, record: tuple) -> bool:
    """Whether the object an ``_into`` record went into, through ``attributes``, holds other
    members than the record's, or one of the objects among them does."""
    name, _, ids, inner = record
    members = tuple(_members(attributes[name]))
    return tuple(map(id, members)) != ids or any(
        tuple(map(id, _members(members[k]))) != inner_ids for k, _, inner_ids in inner)


def _walk(modules: list[torch.nn.Module], alone: list[torch.nn.Module] = (),
          ) -> list[tuple[torch.nn.Module, list[torch.Tensor], tuple[str, ...]]]:
    """Every parameter, buffer and tensor attribute of ``modules`` and their submodules, and
    of ``alone`` (not their submodules), per (sub)module that holds it, with the names of the
    attributes it was found under."""
    scan, walked, out = _Scan(), set(), []
    for sub in itertools.chain(itertools.chain.from_iterable(m.modules() for m in modules),
                               alone):
        if id(sub) not in walked:  # else a submodule of another root module
            walked.add(id(sub))
            out.append((sub, *scan.module(sub)))
    return out


# dtypes whose elements are their bytes as they are (``fp.bits`` resolves nothing)
_AS_BYTES = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype)
                      and not d.is_complex and d not in (torch.qint8, torch.quint8,
                                                         torch.qint32, torch.quint4x2,
                                                         torch.quint2x4))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a flat uint8 tensor (a copy only where ``t`` is not contiguous)."""
    if t.dtype in _AS_BYTES and t.is_contiguous() and not t.is_neg():
        return t.view(-1).view(torch.uint8)  # ``fp.bits``'s answer, with fewer calls
    return fp.bits(t).reshape(-1).view(torch.uint8)


class State:
    """The reached tensors as a recompute found them and as it left them (see the module
    docstring): ``settle`` at the recompute's end reads the counters and copies the small
    tensors' bytes again, so a write after it -- a later region's recompute reaching the same
    buffer (a block's own, in each layer's region), the backward itself, the next
    forward -- is not taken for this recompute's (compared at the backward's end instead, a
    write by the first layer's recompute was named for the region recomputed before it)."""

    def __init__(self, reached_tensors: Reached | list[torch.Tensor]):
        found = (reached_tensors if isinstance(reached_tensors, Reached)
                 else Reached.of(reached_tensors))
        self.snapshots: dict[torch.device, tuple[list[int], torch.Tensor]] = {}
        self.declarations = _intended.entered()
        self.small: list[torch.Tensor] = []
        released: list[torch.Tensor] = []  # small, storage released: by counter
        groups: dict[torch.device, list[int]] = {}
        # each small tensor's signature (``_signatures``), as found: whether it can be read
        # is answered from it (``_fits``) -- ``fp.readable`` asks torch six things a tensor
        signatures = (_signatures(found.small)  # a subclass's would run its own code
                      if set(map(type, found.small)) <= _PLAIN_TYPES else None)
        fits = (map(fp.readable, found.small) if signatures is None
                else map(_fits, found.small, signatures))
        kept: list[tuple] = []
        for i, (t, readable) in enumerate(zip(found.small, fits, strict=True)):
            if readable:
                groups.setdefault(t.device, []).append(len(self.small))
                self.small.append(t)
                if signatures is not None:
                    kept.append(signatures[i])
            elif t.layout is torch.strided and not t.is_meta:
                released.append(t)
        self._signatures = kept if signatures is not None else None
        if self._signatures is not None:
            self.metas = [s[3] for s in self._signatures]
        else:
            self.metas = list(map(_SHAPE_DTYPE, self.small))
        versioned = found.versioned + released if released else found.versioned
        # the counters read in one pass each (no call per tensor: a kept walk reaches every
        # parameter of megatron's block from each of its layers' regions)
        self._versioned: list[torch.Tensor] | None = versioned
        self._counts: list[int] | None = list(map(_VERSION, versioned))
        self._settled: list[tuple[torch.Tensor, int]] = []
        # The byte views of the snapshot, kept until ``settle`` copies them again: views of
        # the same storages, made once. Each tensor's data pointer with them: a tensor given
        # another storage (``set_``, ``.data =``) leaves its view reading the old one, so its
        # bytes are then read where they are now (``_now``).
        self._views: dict[torch.device, list[torch.Tensor]] = {}
        self._pointers = ([s[0] for s in self._signatures] if self._signatures is not None
                          else list(map(_DATA_PTR, self.small)))
        self._after: dict[torch.device, torch.Tensor | list] | None = None  # (``settle``)
        self.declared: int | None = None  # ``_intended.entered()`` when the recompute ended
        # devices where some "view" is a copy (a transposed, conjugate or negative-bit tensor
        # has no byte view): read again at ``settle`` (a frozen copy hid the write)
        self._copied: set[torch.device] = set()
        if not groups:
            return
        grad = torch.is_grad_enabled()  # (torch.no_grad() costs a few Python calls more)
        torch._C._set_grad_enabled(False)
        try:
            with torch._C._DisableTorchDispatch():
                for device, indices in groups.items():  # a copy: one kernel per device
                    views = self._views[device] = [_bytes(self.small[i]) for i in indices]
                    if list(map(_DATA_PTR, views)) != [self._pointers[i] for i in indices]:
                        self._copied.add(device)
                    self.snapshots[device] = (indices, torch.cat(views))
        finally:
            torch._C._set_grad_enabled(grad)

    @property
    def versions(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, its counter when the recompute began) for each tensor compared by counter:
        all of them until ``settle``, after it those whose counter moved."""
        if self._versioned is None:
            return self._settled
        return list(zip(self._versioned, self._counts, strict=True))

    def _same(self, i: int) -> bool:
        """Small tensor ``i`` of the shape and dtype it had, and readable."""
        t = self.small[i]
        return (t.shape, t.dtype) == self.metas[i] and fp.readable(t)

    def _now(self, device: torch.device) -> torch.Tensor | list:
        """A device's small tensors' bytes now: one copy where each is of the shape and dtype
        the snapshot found, else one per tensor (None where not: changed, with no
        comparison). The snapshot's views are read where every tensor keeps its storage; a
        storage swapped since (``set_``, ``.data =``: equal bytes there are no change) or a
        view that was a copy is read where the bytes are now."""
        indices = self.snapshots[device][0]
        tensors = [self.small[i] for i in indices]
        if (self._signatures is not None and device not in self._copied
                and _signatures(tensors) == [self._signatures[i] for i in indices]):
            with torch._C._DisableTorchDispatch():  # as found: the views read them
                return torch.cat(self._views[device])
        if (list(map(_SHAPE_DTYPE, tensors)) == [self.metas[i] for i in indices]
                and all(map(fp.readable, tensors))):
            if device not in self._copied and list(map(_DATA_PTR, tensors)) == [
                    self._pointers[i] for i in indices]:
                with torch._C._DisableTorchDispatch():  # the views require no grad
                    return torch.cat(self._views[device])
            with torch.no_grad(), torch._C._DisableTorchDispatch():
                return torch.cat([_bytes(t) for t in tensors])
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            return [_bytes(self.small[i]).clone() if self._same(i) else None for i in indices]

    def _afters(self) -> dict[torch.device, torch.Tensor | list]:
        """The bytes as the recompute left them (``settle``); before it, as they are now."""
        if self._after is not None:
            return self._after
        return {device: self._now(device) for device in self.snapshots}

    def pairs(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor] | None]:
        """Per device: the small tensors' bytes as the recompute left them and the snapshot
        from before (``changed_flags`` compares them), or None where one changed shape or
        dtype or can no longer be read (changed, without a comparison)."""
        return {device: (after, self.snapshots[device][1])
                if isinstance(after, torch.Tensor) else None
                for device, after in self._afters().items()}

    def flags(self) -> list[torch.Tensor]:
        """One 0-d bool device tensor per device: some small tensor's bits changed."""
        out = []
        for device, pair in self.pairs().items():
            out += ([torch.tensor(True, device=device)] if pair is None
                    else [f for _, f in changed_flags([(0, *pair)])])
        return out

    def settle(self) -> None:
        """The recompute has just ended: copy the small tensors' bytes as it left them (one
        kernel per device), read the version counters and let go of every tensor whose
        counter did not move -- a region's inputs and parameters are not held until the
        backward's end (that raised the backward's peak by every checkpointed layer's input).
        A write after this is not the recompute's."""
        if self._after is None:
            self._after = self._afters()
            self._views = {}
            self.declared = _intended.entered()
        if self._versioned is None:
            return
        now = list(map(_VERSION, self._versioned))
        if now != self._counts:
            self._settled = [(t, v) for t, v, n in zip(self._versioned, self._counts, now,
                                                       strict=True) if n != v]
        self._versioned = self._counts = None

    def host_changed(self) -> bool:
        return any(t._version != v for t, v in self.versions)

    def changed(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(tensor, its bytes from before or None) for each tensor the recompute left changed,
        less scratch and the storages ``fixes.recompute`` replays. Synchronises (a flagged
        region only)."""
        found: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        afters = self._afters()
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            for device, (indices, snapshot) in self.snapshots.items():
                after, offset = afters[device], 0
                for k, i in enumerate(indices):
                    n = self.metas[i][0].numel() * self.metas[i][1].itemsize
                    before = snapshot[offset:offset + n]
                    now = after[offset:offset + n] if isinstance(after, torch.Tensor) \
                        else after[k]
                    offset += n
                    if now is None or bool((now != before).any()):
                        # given back only into the storage the snapshot read (a tensor
                        # given another one's storage since would overwrite that one)
                        t = self.small[i]
                        found.append((t, before if t.data_ptr() == self._pointers[i]
                                      else None))
        found += [(t, None) for t, v in self.versions if t._version != v]
        if not found:
            return found
        managed = recompute_state.managed_storages()
        return [(t, c) for t, c in found
                if (key := t.untyped_storage()._cdata) not in managed
                and _intended.scratch_reason(key) is None]

    @staticmethod
    def restore(t: torch.Tensor, before: torch.Tensor) -> bool:
        """Give ``t`` its bits from ``before`` back; False where it cannot be (its shape or
        dtype changed, or its bits are no view of it: a quantized tensor)."""
        if t.is_quantized or t.numel() * t.element_size() != before.numel():
            return False
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            target = fp.bits(t)
            if target.data_ptr() != t.data_ptr():  # resolved a conjugate or negative bit
                return False
            # a copy of the slice: its offset in the snapshot need not suit the dtype
            target.copy_(before.clone().view(target.dtype).view(target.shape))
        return True


def changed_flags(items: list[tuple[object, torch.Tensor, torch.Tensor]],
                  ) -> list[tuple[object, torch.Tensor]]:
    """``(key, the bytes after, the snapshot before)`` of states on one device -> ``(key, a
    0-d bool device tensor: some bit changed)`` each. No synchronisation."""
    with torch.no_grad(), torch._C._DisableTorchDispatch():
        return [(key, (after != before).any()) for key, after, before in items]


def any_changed(items: list[tuple[object, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One 0-d bool device tensor: some bit of any of ``items`` (as ``changed_flags``) changed
    -- a backward's regions in one comparison (four kernels, not two a region); only where
    it is set does each region need its own flag. No synchronisation."""
    with torch.no_grad(), torch._C._DisableTorchDispatch():
        now = torch.cat([after for _, after, _ in items])
        return (now != torch.cat([before for _, _, before in items])).any()


def roots_of(fn, args, kwargs=None) -> list:
    """The objects a region's state is reached from: its function and its tensor arguments."""
    if not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args):
        leaves = args  # megatron's and torch's checkpoints: tensors and plain values
    else:
        leaves = pytree.tree_leaves((args, kwargs or {}))
    leaves = [x for x in leaves if isinstance(x, (torch.Tensor, torch.nn.Module))]
    return [fn, *leaves]
