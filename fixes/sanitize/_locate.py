"""Where a recompute first departs from its forward, once a verdict (``_verdict``) says that
it computed something else where backward would use it.

The two op streams are aligned by (op, call site) -- ``difflib``'s longest matching blocks --
so an op that one side ran and the other did not (a cache built on first use, a hook that
runs in the forward only, a branch taken on changed state, an op folded differently with
grad mode on) is a block of its own, never paired with whatever op sat at its position.
Then, in stream order:

* the first aligned pair whose outputs' metadata or fingerprints differ is where the values
  part (``VALUES`` / ``METADATA``);
* unless a block of ops only one side ran comes right before it (no pair verified equal in
  between): then that block is where they part (``OP``) -- the branch whose other op made the
  values differ;
* without such a pair (``none`` mode, or nothing differs where fingerprinted) the first block
  of one-sided ops, if any (``OP``); else ``UNLOCATED``.

A non-reentrant recompute stops after its last saved tensor: the forward's ops after that are
not a difference. ``sampled`` streams compare only the ops both sides fingerprinted; the
report then names the interval the first difference lies in.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from fixes.sanitize import _fingerprint as fp
from fixes.sanitize import _intended
from fixes.sanitize._errors import Divergence
from fixes.sanitize._stream import OpRecord


@dataclass(frozen=True, slots=True)
class Location:
    what: Divergence
    forward: int | None  # the op's index in the forward's stream (None: only the recompute ran it)
    recompute: int | None  # in the recompute's (None: only the forward ran it)
    detail: str
    interval: tuple[int, int] | None = None  # sampled: the recompute ops it lies between
    # For an op outside the op streams (a declared write): its name and raw recompute site.
    op: object | None = None
    recompute_site: tuple | None = None
    block: tuple[int, int, int, int] | None = None  # OP: the one-sided ops (f1, f2, r1, r2)


def _key(record: OpRecord) -> tuple:
    return (record.op, tuple((id(code), line) for code, line in record.site))


def _same_line(a: OpRecord, b: OpRecord) -> bool:
    return bool(a.site) and bool(b.site) and a.site[0] == b.site[0]


@dataclass(slots=True)
class _Pair:
    f: int
    r: int
    compared: int | None = None  # its index among the pairs with prints on both sides


@dataclass(slots=True)
class _Block:
    tag: str  # difflib's: replace, delete, insert
    f1: int
    f2: int
    r1: int
    r2: int


class Alignment:
    """The forward's and a recompute's op streams, aligned (see the module docstring) when
    first asked: a recompute without a difference never pays for the alignment."""

    def __init__(self, forward: list[OpRecord], recompute: list[OpRecord], stopped_early: bool):
        self.forward, self.recompute, self.stopped_early = forward, recompute, stopped_early
        self._walk: list[_Pair | _Block] | None = None
        self.to_recompute: dict[int, int] = {}
        self.to_forward: dict[int, int] = {}

    @property
    def walk(self) -> list[_Pair | _Block]:
        if self._walk is None:
            self._walk = self._align()
        return self._walk

    def _align(self) -> list[_Pair | _Block]:
        forward, recompute, stopped_early = self.forward, self.recompute, self.stopped_early
        matcher = difflib.SequenceMatcher(None, [_key(r) for r in forward],
                                          [_key(r) for r in recompute], autojunk=False)
        walk: list[_Pair | _Block] = []
        for tag, f1, f2, r1, r2 in matcher.get_opcodes():
            if tag == "equal":
                for k in range(f2 - f1):
                    walk.append(_Pair(f1 + k, r1 + k))
                    self.to_recompute[f1 + k], self.to_forward[r1 + k] = r1 + k, f1 + k
            elif not (stopped_early and tag == "delete" and r1 == len(recompute)):
                walk.append(_Block(tag, f1, f2, r1, r2))
        return walk

    def locate(self, sampled: bool) -> Location:
        pairs = [p for p in self.walk if isinstance(p, _Pair)]
        printed = []
        for p in pairs:
            a, b = self.forward[p.f].print, self.recompute[p.r].print
            if a is not None and b is not None:
                p.compared = len(printed)
                printed.append((a, b))
        first_values = fp.first_different(printed) if printed else None
        at = None
        for n, item in enumerate(self.walk):
            if not isinstance(item, _Pair):
                continue
            if self.forward[item.f].meta != self.recompute[item.r].meta:
                at, what = n, Divergence.METADATA
                break
            if first_values is not None and item.compared == first_values:
                at, what = n, Divergence.VALUES
                break
        if at is None:
            block = next((b for b in self.walk if isinstance(b, _Block)), None)
            if block is None:
                return Location(Divergence.UNLOCATED, None, None,
                                "the op streams agree wherever both sides were fingerprinted")
            return self._block(block)
        for item in reversed(self.walk[:at]):
            if isinstance(item, _Block):
                return self._block(item)
            if item.compared is not None:
                break  # verified equal: the difference arose after it
        pair = self.walk[at]
        return self._pair(pair, what, sampled)

    def _pair(self, pair: _Pair, what: Divergence, sampled: bool) -> Location:
        f, r = self.forward[pair.f], self.recompute[pair.r]
        if what is Divergence.METADATA:
            detail = (f"outputs of {f.op}: forward {describe_meta(f.meta)}, recompute "
                      f"{describe_meta(r.meta)}")
        else:
            how = "within the atomics tolerance" if f.print.approx else "bitwise"
            detail = (f"values of {f.op} (compared {how}): forward {fp.describe(f.print)}, "
                      f"recompute {fp.describe(r.print)}")
        interval = None
        if sampled and what is Divergence.VALUES:
            start = 0
            for item in self.walk:
                if item is pair:
                    break
                if isinstance(item, _Pair) and item.compared is not None:
                    start = item.r + 1
            interval = (start, pair.r)
        return Location(what, pair.f, pair.r, detail, interval)

    def _block(self, block: _Block) -> Location:
        f_op = self.forward[block.f1] if block.f1 < block.f2 else None
        r_op = self.recompute[block.r1] if block.r1 < block.r2 else None
        span = (block.f1, block.f2, block.r1, block.r2)
        if f_op is not None and r_op is not None and _same_line(f_op, r_op):
            return Location(Divergence.OP, block.f1, block.r1,
                            f"the recompute ran {r_op.op} where its forward ran {f_op.op}",
                            block=span)
        if r_op is not None:
            others = block.r2 - block.r1 - 1
            more = f" (and {others} more after it)" if others else ""
            return Location(Divergence.OP, None, block.r1,
                            f"the recompute ran {r_op.op}{more}, which its forward did not "
                            "run: no forward op corresponds to it", block=span)
        others = block.f2 - block.f1 - 1
        more = f" (and {others} more after it)" if others else ""
        return Location(Divergence.OP, block.f1, None,
                        f"the forward ran {f_op.op}{more}, which the recompute did not run",
                        block=span)

    def is_lowering(self, location: Location) -> bool:
        """True if ``location`` is a block of ops that only lower one Python call differently
        (``_intended.GRAD_MODE_LOWERING``): every op of it a view, copy or matmul kernel, all
        at one call site."""
        if location.what is not Divergence.OP or location.block is None:
            return False
        f1, f2, r1, r2 = location.block
        ops = [*self.forward[f1:f2], *self.recompute[r1:r2]]
        lines = {r.site[0] if r.site else None for r in ops}
        return (len(lines) == 1 and None not in lines
                and all(r.op.overloadpacket in _intended.LOWERING_OPS for r in ops))

    def early_stop(self, written_at: int) -> Location | None:
        """The forward's op ``written_at`` wrote a saved tensor after its pack: if the
        recompute never reached that op, that is where they part."""
        if self.walk is not None and written_at in self.to_recompute:
            return None
        op = self.forward[written_at]
        return Location(Divergence.EARLY_STOP, written_at, None,
                        f"the forward's {op.op} wrote this saved tensor after saving it; the "
                        "recompute stopped after its last saved tensor (early stop) before "
                        "that op, so backward reads the tensor as the op found it "
                        "(pytorch#193671)")

    def forward_of(self, recompute_index: int) -> int | None:
        return self.to_forward.get(recompute_index) if self.walk is not None else None


def describe_meta(meta: tuple) -> str:
    return "[" + ", ".join(f"{list(s)} {str(d).removeprefix('torch.')} {dev}"
                           for s, d, dev in meta) + "]"
