"""The tensors one side of a non-reentrant region saves for backward, in the order the
checkpoint packs them.

That order is the identity ``torch.utils.checkpoint`` itself uses: each forward pack gets a
holder, and the recompute's ``i``-th pack fills the ``i``-th holder, which the node that saved
the forward's ``i``-th tensor unpacks in backward. So entry ``i`` of the forward and entry
``i`` of a recompute are the same (node, slot); a recompute whose entry differs hands that
node another tensor than the loss was computed from.

Compared is what backward consumes: the forward's tensor as its region's forward left it
(a tensor written after it was packed -- ``nn.RReLU`` packs its ``empty_like`` noise before
``rrelu_with_noise`` fills it -- is fingerprinted again after each write), against the
recompute's as the recompute left it (an early-stopped recompute stops right after its last
pack: pytorch#193671). Entries are recorded by wrapping the saved-tensor hooks on top when the
side starts (the checkpoint's own), so both see every pack.

Fingerprinted (``_modes.Values``): every entry (``all``); entries ``0, n, 2n, ...`` and each
side's last (``sampled``); none, metadata only (``none``). A tensor an op returns its own RNG
state in (``_fingerprint.valued_returns``) is compared by metadata only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fixes.sanitize import _fingerprint as fp
from fixes.sanitize._modes import Values
from fixes.sanitize._stream import OpStream


@dataclass(slots=True)
class Saved:
    index: int
    position: int  # ops in the side's stream when it was packed
    meta: tuple
    valued: bool  # its values are compared (not an op's RNG state)
    tolerant: bool  # printed tolerantly (after an op not deterministic on its device)
    print: fp.Print | None = None
    tensor: torch.Tensor | None = None  # held until it is fingerprinted
    ref: weakref.ref | None = None  # forward: to fingerprint it again after a write
    storage: int | None = None
    written_at: int | None = None  # forward: the op that last wrote it after its pack


def _is_state_output(x: torch.Tensor, stream: OpStream) -> bool:
    keep, outs = stream.last_keep, stream.last_outs
    if keep is None or len(keep) != len(outs):
        return False
    return any(o is x and not k for o, k in zip(outs, keep, strict=True))


class SavedTensors:
    """The saved tensors of one side (``forward``: the region's forward; else a recompute),
    recorded while ``entered``; ``on_error(exc)`` is told of a failure of the sanitizer's own
    (the pack itself always goes through)."""

    def __init__(self, stream: OpStream, forward: bool, on_error: Callable,
                 forward_count: int = 0):
        self.stream, self.forward, self.on_error = stream, forward, on_error
        self.mode, self.every = stream.mode, stream.every
        self.entries: list[Saved] = []
        self.by_storage: dict[int, list[Saved]] = {}
        self.forward_count = forward_count  # a recompute: how many its forward saved
        self._pushed = False
        self._last_unprinted: Saved | None = None

    # -- the hooks ----------------------------------------------------------------------------

    def __enter__(self):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None:
            pack, unpack = top

            # functools.wraps: code that asks which hook is on top (fixes.torchtitan's nested
            # checkpoint check reads its module and qualified name) sees the checkpoint's.
            @functools.wraps(pack)
            def recording_pack(x):
                try:
                    self._record(x)
                except Exception as exc:  # the sanitizer's failure: never the user's pack
                    self.on_error(exc)
                return pack(x)

            torch._C._autograd._push_saved_tensors_default_hooks(recording_pack, unpack)
            self._pushed = True
        return self

    def __exit__(self, *exc):
        if self._pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._pushed = False
        return False

    def _record(self, x: torch.Tensor) -> None:
        index = len(self.entries)
        stream = self.stream
        entry = Saved(index, len(stream.records), ((tuple(x.shape), x.dtype, x.device.type),),
                      stream.last_keep is None or not _is_state_output(x, stream),
                      stream.tolerant)
        self.entries.append(entry)
        if self.mode is Values.NONE or not entry.valued:
            return
        sampled = self.mode is Values.ALL or index % self.every == 0
        if not self.forward:
            entry.tensor = x  # what backward consumes is what the recompute leaves
            if sampled:
                self.stream.saved_fingerprinted()
            else:
                self.stream.saved_not_fingerprinted()
            return
        if sampled:
            self.stream.saved_fingerprinted()  # first: x is often that op's output
            entry.print = self.stream.print_of(x, entry.tolerant)
            self._track(entry, x)
        else:  # kept in case it is the forward's last
            if self._last_unprinted is not None:
                self._last_unprinted.tensor = None
            entry.tensor = x
            self._last_unprinted = entry
            self.stream.saved_not_fingerprinted()

    def _track(self, entry: Saved, x: torch.Tensor) -> None:
        if x.layout is not torch.strided or x.is_meta:
            return
        entry.ref = weakref.ref(x)
        entry.storage = x.untyped_storage()._cdata
        self.by_storage.setdefault(entry.storage, []).append(entry)

    # -- writes after a pack (forward) --------------------------------------------------------

    def written(self, storages: list[int]) -> list[Saved]:
        """The fingerprinted entries whose storage an op is about to write."""
        return [e for key in storages for e in self.by_storage.get(key, ())]

    def rewritten(self, entries: list[Saved], position: int) -> None:
        """``entries`` were written by op ``position``: fingerprint them again."""
        for e in entries:
            t = e.ref() if e.ref is not None else None
            e.print = None if t is None else fp.fingerprint([t], tolerant=e.tolerant)
            e.written_at = position

    # -- the end of the side ------------------------------------------------------------------

    def finish(self) -> None:
        if self.forward:
            last = self._last_unprinted
            if last is not None and last.tensor is not None:
                last.print = self.stream.print_of(last.tensor, last.tolerant)
                last.tensor = None
            self._last_unprinted = None
            return
        final = len(self.entries) - 1
        for e in self.entries:
            if e.tensor is None:
                continue
            if (self.mode is Values.ALL or e.index % self.every == 0 or e.index == final
                    or e.index == self.forward_count - 1):
                e.print = self.stream.print_of(e.tensor, e.tolerant)
            e.tensor = None
