"""The op stream of one side of a region (its forward, or one recompute): every op with its
outputs' metadata, its call site and -- as the values mode asks -- a fingerprint of its
outputs. The stream is not the verdict (``_verdict``); it locates where a recompute that
differs in what backward uses first departs from its forward (``_locate``).

Fingerprinted: every op (``all``) but views of tensors the side's own ops made -- their values
are those of an op of the stream, so they are recorded with their metadata only (a view of a
parameter, buffer or input is fingerprinted: it may be where a changed value enters, and an
early-stopped recompute may end at it); none (``none``, which keeps no stream at all); or
(``sampled``) the ops at positions
``0, n, 2n, ...``, each side's last op, and the op before each saved tensor the side
fingerprints (``_saved``), so that a saved tensor that differs has the op next to it compared
on both sides. An op's outputs are held only until the next op is recorded (``pending``), one
op's outputs at a time, plus those of the op before the latest saved tensor.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from fixes.sanitize import _fingerprint as fp
from fixes.sanitize import _intended
from fixes.sanitize._modes import Values

# Autograd itself detaches tensors it saves when grad mode is on (a reentrant checkpoint's
# forward runs without grad, its recompute with): a detach changes no value or metadata.
_IGNORED = frozenset({torch.ops.aten.detach.default})


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What the sanitizer needs of an op's schema: read once per op, one lookup per call."""

    skipped: bool  # not in the stream: autograd's detach, allocations (``fp.ALLOCATIONS``)
    fresh: tuple[bool, ...]  # per return: a new tensor (aliases no argument)
    written: tuple[tuple[int, str], ...]  # (position, name) of every argument it writes
    atomic: bool  # accumulates with atomics on CUDA
    keep: tuple[bool, ...]  # per return: its values are a result (not the op's RNG state)
    keeps_all: bool  # every return is a result
    valued: bool  # its outputs are fingerprinted at all (``fp.no_values``)
    unrecorded: bool  # never part of an op stream (``_intended.UNRECORDED_NAMESPACES``)
    view: bool  # every return aliases an argument and nothing is written: a view of a tensor
    # the side made is not fingerprinted in the stream (its values are already there)


_infos: dict = {}
# ``torch.tensor(...)`` inside a region: a constant made outside dispatch, handed to the stream
# by an aliasing ``lift_fresh`` -- the first op that shows its values (not a view of a value the
# stream has)
_LIFTS = frozenset(getattr(torch.ops.aten, n) for n in ("lift", "lift_fresh")
                   if hasattr(torch.ops.aten, n))


def _batch_norms() -> dict:
    # Training-mode batch norm updates running_mean and running_var in place although its
    # schema does not mark them written (and without bumping their version counters).
    stats = ((3, "running_mean"), (4, "running_var"))
    names = ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    return {getattr(torch.ops.aten, n).default: stats for n in names
            if hasattr(torch.ops.aten, n)}


# Ops that write arguments their schema does not mark as written: (position, name).
UNMARKED_WRITES = _batch_norms()


def _unmarked_writes(func, schema) -> tuple[tuple[int, str], ...]:
    found = UNMARKED_WRITES.get(func)
    if found is not None:
        return found
    # c10d's in-place collectives (allreduce_, _allgather_base_, broadcast_, ...) write their
    # first argument, unmarked: the output of an all-gather, the tensors reduced in place.
    if func.namespace == "c10d" and schema.name.endswith("_") and schema.arguments:
        return ((0, schema.arguments[0].name),)
    return ()


def info(func) -> OpInfo:
    found = _infos.get(func)
    if found is None:
        schema = func._schema
        marked = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write)
        found = _infos[func] = OpInfo(
            skipped=func in _IGNORED or func.overloadpacket in fp.ALLOCATIONS,
            # a lifted constant (``torch.tensor(...)``) is new although its return aliases
            fresh=tuple(r.alias_info is None or func.overloadpacket in _LIFTS
                        for r in schema.returns),
            written=marked + _unmarked_writes(func, schema),
            atomic=func.overloadpacket in fp.ATOMIC_ON_CUDA,
            keep=(keep := fp.valued_returns(func)), keeps_all=all(keep),
            valued=not fp.no_values(func),
            unrecorded=func.namespace in _intended.UNRECORDED_NAMESPACES,
            view=bool(schema.returns) and not marked and func.overloadpacket not in _LIFTS
            and all(r.alias_info is not None for r in schema.returns))
    return found


@dataclass(slots=True)
class OpRecord:
    op: object  # the OpOverload
    meta: tuple
    site: tuple  # raw (``_opsite.raw_site``)
    print: fp.Print | None = None


class OpStream:
    """The ops one side of a region ran, fingerprinted as its mode asks (module docstring)."""

    def __init__(self, mode: Values, every: int):
        self.mode, self.every = mode, every
        self.records: list[OpRecord] = []
        self.tolerant = False  # from the first op not deterministic on its device on
        self.fingerprints = 0
        self.pending: tuple | None = None  # (record, valued outputs) not fingerprinted yet
        self.before_saved: tuple | None = None  # the op before the latest unsampled save
        self.last_outs: list[torch.Tensor] = []  # the latest op's outputs (for ``_saved``)
        self.last_keep: tuple[bool, ...] | None = None  # None: every output is a result
        # id(tensor) -> (weakref, version, tolerant, print) of every tensor printed alone on
        # this side: a tensor saved for backward that an op just made (or saved before, as a
        # weight used by every layer) is printed once, while its version stays.
        self._memo: dict[int, tuple] = {}

    def add(self, func, outs: list[torch.Tensor], op: OpInfo, site: tuple,
            inner: bool = False) -> OpRecord:
        """Record ``func``'s call; ``inner``: a view of tensors this side's ops made (recorded,
        not fingerprinted, and the op held for ``sampled`` stays held)."""
        record = OpRecord(func, fp.metadata(outs), site)
        position = len(self.records)
        self.records.append(record)
        self.last_outs, self.last_keep = outs, (None if op.keeps_all else op.keep)
        if inner:
            return record
        if op.atomic and not self.tolerant and fp.is_inexact(outs):
            self.tolerant = True
        if self.mode is Values.NONE or not op.valued:
            self.pending = None
            return record
        valued = fp.valued_outputs(func, outs, op.keep)
        if self.mode is Values.ALL or position % self.every == 0:
            self._fingerprint(record, valued)
            self.pending = None
        else:
            self.pending = (record, valued)
        return record

    def saved_fingerprinted(self) -> None:
        """A saved tensor was fingerprinted: fingerprint the latest op too (``sampled``)."""
        if self.pending is not None:
            self._fingerprint(*self.pending)
            self.pending = None

    def saved_not_fingerprinted(self) -> None:
        """A saved tensor was not fingerprinted (yet): keep the latest op, in case it is the
        side's last saved tensor (``sampled``)."""
        if self.pending is not None:
            self.before_saved = self.pending

    def finish(self) -> None:
        for held in (self.pending, self.before_saved):
            if held is not None and held[0].print is None:
                self._fingerprint(*held)
        self.pending = self.before_saved = None
        self.last_outs = []
        self._memo.clear()

    def print_of(self, t: torch.Tensor, tolerant: bool, checked: bool = True) -> fp.Print | None:
        """``t``'s print: the one this side made of it already if its version has not moved
        since, else a new one."""
        known = self._memo.get(id(t))
        if (known is not None and known[0]() is t and known[1] == t._version
                and known[2] == tolerant):
            return known[3]
        found = fp.fingerprint([t], tolerant=tolerant, checked=checked)
        self._remember(t, tolerant, found)
        return found

    def _remember(self, t: torch.Tensor, tolerant: bool, found: fp.Print | None) -> None:
        if found is not None:
            self._memo[id(t)] = (weakref.ref(t), t._version, tolerant, found)

    def _fingerprint(self, record: OpRecord, valued: list[torch.Tensor]) -> None:
        if len(valued) == 1:
            record.print = self.print_of(valued[0], self.tolerant, checked=False)
        else:
            record.print = fp.fingerprint(valued, tolerant=self.tolerant, checked=False)
        if record.print is not None:
            self.fingerprints += 1
