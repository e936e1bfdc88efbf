"""Writes of one recompute into tensors that live outside its region (a module buffer, a
parameter, a counter, a cache, the region's own inputs): the tensor as it was before the
recompute first wrote it, and whether the recompute left it so.

A recompute runs inside ``backward()``, after the forward already made its effects; a write
that the recompute leaves in place applies such an effect a second time (torchtitan #4568: a
tokens-per-expert buffer counted twice; pytorch#96136: BatchNorm's running statistics updated
twice). A write whose net effect is none -- a stash and restore, TransformerEngine's FP8 meta
handling -- or one into a tensor the recompute created, is no side effect. When one is found
the tensor is given its contents from before the recompute back, then it is reported.

Not checked: writes into scratch (``_intended.scratch_reason``), into the storages
``fixes.recompute`` replays from a snapshot (``managed_storages``), writes under a
``scratch`` declaration, and an ``update`` declaration's writes when the forward made none
under it (``_intended``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fixes.sanitize import _fingerprint as fp
from fixes.sanitize._intended import Declaration, Writes


@dataclass(slots=True)
class Written:
    tensor: torch.Tensor
    before: torch.Tensor  # a copy of its bits before the recompute's first write
    op: object
    argument: str
    position: int  # the recompute's op stream length at the first write
    site: tuple  # raw, of the first write
    recorded: bool  # the first write is an op of the recompute's op stream (not declared)
    declarations: set = field(default_factory=set)  # of every write (None: undeclared)


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype)


class OutsideWrites:
    """The outside tensors one recompute writes (see the module docstring)."""

    def __init__(self):
        self.written: dict[tuple, Written] = {}

    def before_write(self, func, tensor: torch.Tensor, argument: str, position: int,
                     site: tuple, declaration: Declaration | None) -> None:
        key = _view_key(tensor)
        found = self.written.get(key)
        if found is not None:
            found.declarations.add(declaration)
            return
        if not fp.readable(tensor):
            return  # released storage (FSDP's reshard): nothing to compare, nothing read
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            before = fp.bits(tensor).clone()  # as integers: every dtype clones
        self.written[key] = Written(tensor, before, func, argument, position, site,
                                    declaration is None, {declaration})

    def left_changed(self, forward_updates: set) -> list[Written]:
        """The tensors the recompute left other than it found them, in the order of their first
        writes, less those whose every write was an ``update`` declaration the forward made
        no write under."""
        changed = []
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            for w in self.written.values():
                if all(d is not None and d.writes is Writes.UPDATE and d not in forward_updates
                       for d in w.declarations):
                    continue
                if not fp.readable(w.tensor):
                    continue
                now = fp.bits(w.tensor)
                if now.shape != w.before.shape or not torch.equal(now, w.before):
                    changed.append(w)
        return sorted(changed, key=lambda w: w.position)

    def restore(self, changed: list[Written]) -> None:
        """Give ``changed`` their contents from before the recompute back (last first)."""
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            for w in reversed(changed):
                if fp.readable(w.tensor):
                    fp.bits(w.tensor).copy_(w.before)

    def clear(self) -> None:
        self.written.clear()
