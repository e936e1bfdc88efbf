"""One checkpointed region as ``recompute_sanitizer()`` sees it: the ops its forward ran,
recorded by a dispatch mode, and each recompute compared with them op by op.

The contract: a region's recompute replays its forward. At op ``i`` of a recompute the op, its
output metadata (shape, dtype, device per output) and -- once the recompute ends -- its value
fingerprint equal those of op ``i`` of the forward (values within ``_fingerprint``'s tolerance
from the first op whose device kernel is not deterministic on). Ops are counted without
autograd's detaches and without allocations (``_fingerprint.ALLOCATIONS``: whether a cache
allocates depends on its state, not on the region). A recompute may stop early
(non-reentrant checkpoint stops after the last tensor it needs): then the ops it ran are a
prefix of the forward's; one that runs to the end ran as many ops as the forward. An op of a
recompute that would write a tensor no op of that recompute created is a replayed side effect
and raises before it runs, unless ``fixes.recompute`` replays that tensor's state from a
snapshot. (A selective-AC policy that saves such an in-place op would skip it in the
recompute; it is reported all the same.)

Metadata is compared at each op (host only); values once per recompute, with one host
synchronisation per device, so that no op waits for its kernels. The modes are entered inside
the region, innermost: a selective-AC mode (or torch_remat's) that serves saved outputs in the
recompute sees the ops after this one, in the forward and the recompute alike.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from fixes.recompute import state as recompute_state
from fixes.sanitize import _fingerprint as fp
from fixes.sanitize import _opsite
from fixes.sanitize._callsite import describe_site
from fixes.sanitize._opsite import format_site, raw_site

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class RecomputeMismatchError(RuntimeError):
    """A checkpointed region's recompute did not replay its forward. ``what`` is one of
    ``op``, ``metadata``, ``values``, ``length``, ``side effect``; ``position`` the op's index
    in the region; the sites are ``file:line in function`` tuples, innermost first."""

    def __init__(self, message: str, *, region: str, what: str, position: int, op: str,
                 forward_site: tuple[str, ...], recompute_site: tuple[str, ...]):
        self.region, self.what, self.position, self.op = region, what, position, op
        self.forward_site, self.recompute_site = forward_site, recompute_site
        super().__init__(message)


# -- per-op bookkeeping ------------------------------------------------------------------------

# Autograd itself detaches tensors it saves when grad mode is on (a reentrant checkpoint's
# forward runs without grad, its recompute with): a detach changes no value or metadata.
_IGNORED = frozenset({torch.ops.aten.detach.default})


@dataclass(frozen=True, slots=True)
class _OpInfo:
    """What the comparison needs of an op's schema: read once per op, one lookup per call."""

    skipped: bool  # not compared: autograd's detach, allocations (``_fingerprint.ALLOCATIONS``)
    fresh: tuple[bool, ...]  # per return: a new tensor (aliases no argument)
    written: tuple[tuple[int, str], ...]  # (position, name) of every argument it writes
    atomic: bool  # accumulates with atomics on CUDA
    keep: tuple[bool, ...]  # per return: its values are compared (not RNG state)


_infos: dict = {}


def _info(func) -> _OpInfo:
    info = _infos.get(func)
    if info is None:
        schema = func._schema
        info = _infos[func] = _OpInfo(
            skipped=func in _IGNORED or func.overloadpacket in fp.ALLOCATIONS,
            fresh=tuple(r.alias_info is None for r in schema.returns),
            written=tuple((i, a.name) for i, a in enumerate(schema.arguments)
                          if a.alias_info is not None and a.alias_info.is_write),
            atomic=func.overloadpacket in fp.ATOMIC_ON_CUDA,
            keep=fp.valued_returns(func))
    return info


@dataclass(slots=True)
class OpRecord:
    op: object  # the OpOverload
    meta: tuple
    site: tuple  # raw
    fingerprint: list[torch.Tensor] | None  # 0-d float64 tensors (``_fingerprint``)
    inexact: bool
    scale: list[float] | None  # tolerance multipliers per fingerprint entry, when inexact


def _describe_meta(meta: tuple) -> str:
    return "[" + ", ".join(f"{list(s)} {str(d).removeprefix('torch.')} {dev}"
                           for s, d, dev in meta) + "]"


def _subclass_dispatch(types):
    """NotImplemented to let a wrapper subclass (DTensor) unwrap first; a callable marker for
    fake / functional tensors (no real values: passed through); None for plain tensors."""
    for t in types:
        if t not in _PLAIN:
            return NotImplemented if is_traceable_wrapper_subclass_type(t) else "pass"
    return None


class _Ops:
    """The ops one side of a region ran (its forward, or one recompute), with the value
    fingerprints its mode asks for: every op's (``all``), none (``none``), or (``sampled``)
    those at positions ``0, n, 2n, ...``, the region's known ``stop`` and the side's last op,
    whose outputs are held until the next op is recorded or the side ends (``finish``) -- one
    op's outputs, briefly."""

    def __init__(self, region: Region):
        self.region, self.records = region, []
        self.mode, self.every, self.stop = region.values, region.stats.sample_every, region.stop
        self.last: tuple | None = None  # (record, func, valued outputs) not fingerprinted yet

    def add(self, func, outs: list[torch.Tensor], info: _OpInfo) -> OpRecord | None:
        if info.skipped or (site := raw_site(self.region.opaque)) is None:
            return None
        record = OpRecord(func, fp.metadata(outs), site, None,
                          info.atomic and fp.is_inexact(outs), None)
        position = len(self.records)
        self.records.append(record)
        if self.mode == "none":
            return record
        valued = fp.valued_outputs(func, outs, info.keep)
        if self.mode == "all" or position % self.every == 0 or position == self.stop:
            self._fingerprint(record, func, valued)
            self.last = None
        else:
            self.last = (record, func, valued)
        return record

    def finish(self) -> None:
        if self.last is not None:
            self._fingerprint(*self.last)
            self.last = None

    def _fingerprint(self, record: OpRecord, func, valued) -> None:
        with torch._C._DisableTorchDispatch():  # no other mode sees (or caches) these kernels
            record.fingerprint = fp.fingerprint(func, valued)
        if record.fingerprint is not None:
            record.scale = fp.rtol_scale(valued)
            self.region.stats.fingerprints += 1


class _RegionMode(TorchDispatchMode):
    """A region's dispatch mode: subclass dispatch passes through; every other op runs through
    ``run(func, args, kwargs)``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (special := _subclass_dispatch(types)) is not None:
            return special if special is NotImplemented else func(*args, **(kwargs or {}))
        return self.run(func, args, kwargs or {})


class _RecordForward(_RegionMode):
    def __init__(self, region: Region):
        super().__init__()
        self.ops = _Ops(region)
        region.ops = self.ops.records

    def run(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self.ops.add(func, fp.tensors(out), _info(func))
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        self.ops.finish()
        return result


class _CompareRecompute(_RegionMode):
    def __init__(self, replay: Replay):
        super().__init__()
        self.replay = replay

    def run(self, func, args, kwargs):
        info = _info(func)
        if info.written:
            self.replay.refuse_outside_writes(func, info.written, args, kwargs)
        out = func(*args, **kwargs)
        self.replay.check(func, out, info)
        return out


# Per non-reentrant checkpoint call (kind, label, call line): the op its last recompute
# stopped at, None if it ran to the end. Process-wide: what it records is the code's, not one
# sanitizer's (a training loop may enter a sanitizer per step).
STOPS: dict[tuple, int | None] = {}


class Region:
    """One call of a checkpoint: its forward's ops, and the recomputes compared with them."""

    def __init__(self, kind: str, label: str, site: tuple[str, ...], stats,
                 opaque: bool = False, replays_to_end: bool = True):
        # stats: the RecomputeSanitizer (its values mode, sample_every and counters)
        self.kind, self.label, self.site, self.stats = kind, label, site, stats
        # The values mode of this region. A non-reentrant recompute stops after the last saved
        # tensor, short of the forward's last op, so sampling alone could leave nothing but
        # position 0 to compare: such a region is sampled only once a recompute at its call
        # site said where it stops (``stop``: that op is fingerprinted too); until then, in
        # full. Reentrant recomputes run to the end: sampled from the first.
        self.key = None if replays_to_end else (kind, label, site[:1])  # the checkpoint call
        self.stop: int | None = None
        self.values = stats.values
        if stats.values == "sampled" and self.key is not None:
            if self.key in STOPS:
                self.stop = STOPS[self.key]
            else:
                self.values = "all"
        self.opaque = opaque  # a torch_remat region (see raw_site)
        self.ops: list[OpRecord] = []
        self.recorded = False

    def name(self) -> str:
        return f"{self.label} ({self.kind}, checkpointed at {describe_site(self.site)})"

    def recording(self) -> _RecordForward:
        self.stats.regions += 1
        self.recorded = True
        return _RecordForward(self)

    def replay(self) -> Replay:
        return Replay(self)

    def function(self, fn):
        """``fn`` as a reentrant checkpoint calls it: the first call is the forward (recorded),
        every later call a recompute (compared)."""

        def region_function(*args, **kwargs):
            if not self.recorded:
                with self.recording():
                    return fn(*args, **kwargs)
            with self.replay():
                return fn(*args, **kwargs)

        region_function.__wrapped__ = fn
        return region_function

    def replaying(self, fn):
        """``fn`` as a non-reentrant checkpoint's recompute calls it: every call compared."""

        def recompute_function(*args, **kwargs):
            with self.replay():
                return fn(*args, **kwargs)

        recompute_function.__wrapped__ = fn
        return recompute_function


# The frames that enter a region's code from the sanitizer (see _opsite.raw_site).
_opsite.BOUNDARIES.update(c for f in (Region.function, Region.replaying)
                          for c in f.__code__.co_consts if isinstance(c, types.CodeType))


class Replay:
    """One recompute of a region, compared with its forward (a context manager)."""

    def __init__(self, region: Region):
        self.region = region
        self._ops = _Ops(region)
        self.ops: list[OpRecord] = self._ops.records
        self.created: set[int] = set()  # storages of tensors the recompute's ops made
        self.mode = _CompareRecompute(self)

    def __enter__(self):
        self.region.stats.recomputes += 1
        self.mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.mode.__exit__(exc_type, exc, tb)
        stopped_early = exc_type is not None and exc_type.__name__ == "_StopRecomputationError"
        if exc_type is not None and not stopped_early:
            return False  # the recompute failed by itself: that error is the news
        self._ops.finish()
        if self.region.key is not None:  # where this call site's recomputes stop (or None)
            STOPS[self.region.key] = len(self.ops) - 1 if stopped_early else None
        self._check_values()
        if not stopped_early and len(self.ops) != len(self.region.ops):
            n, forward = len(self.ops), self.region.ops
            self._raise("length", n, forward[n] if n < len(forward) else None,
                        f"the recompute ran {len(self.ops)} ops, its forward "
                        f"{len(self.region.ops)}")
        return False

    # -- side effects --------------------------------------------------------------------------

    def refuse_outside_writes(self, func, written, args, kwargs) -> None:
        """Raise, before it runs, if ``func`` writes (its arguments ``written``) a tensor this
        recompute did not create."""
        managed = None
        for index, name in written:
            t = args[index] if index < len(args) else kwargs.get(name)
            for leaf in pytree.tree_leaves(t):
                if not isinstance(leaf, torch.Tensor) or leaf.is_meta:
                    continue
                key = leaf.untyped_storage()._cdata
                if key in self.created:
                    continue
                managed = recompute_state.managed_storages() if managed is None else managed
                if key not in managed and (site := raw_site()) is not None:
                    self._raise_side_effect(func, name, leaf, site)

    # -- comparison ----------------------------------------------------------------------------

    def check(self, func, out, info: _OpInfo) -> None:
        position = len(self.ops)
        outs = fp.tensors(out)
        for fresh, t in zip(info.fresh, outs, strict=False):
            if fresh and t.layout is torch.strided and not t.is_meta:
                self.created.add(t.untyped_storage()._cdata)
        mine = self._ops.add(func, outs, info)
        if mine is None:
            return
        self.region.stats.ops_compared += 1
        forward = self.region.ops
        if position >= len(forward):
            self._check_values(position)
            self._raise("op", position, None, f"the forward ran {len(forward)} ops; the "
                        f"recompute runs more, here {func}")
        theirs = forward[position]
        if theirs.op is not func:
            self._check_values(position)
            self._raise("op", position, theirs, f"op: forward {theirs.op}, recompute {func}")
        if theirs.meta != mine.meta:
            self._check_values(position)
            self._raise("metadata", position, theirs,
                        f"outputs of {func}: forward {_describe_meta(theirs.meta)}, recompute "
                        f"{_describe_meta(mine.meta)}")

    def _check_values(self, upto: int | None = None) -> None:
        """Raise at the first op (of the first ``upto`` compared) whose values differ. Its
        kernels run past every dispatch mode (a selective-AC mode must not count them)."""
        forward = self.region.ops
        with torch._C._DisableTorchDispatch():
            first, first_inexact = self._first_different_values(upto)
            if first is not None:
                f = torch.stack(forward[first].fingerprint).tolist()
                r = torch.stack(self.ops[first].fingerprint).tolist()
        if first is not None:
            exact = "bitwise" if first < first_inexact else "within the atomics tolerance"
            self._raise("values", first, forward[first],
                        f"values of {forward[first].op} (expected {exact}): (sum, norm) per "
                        f"output: forward {_pairs(f)}, recompute {_pairs(r)}"
                        + self._sampled_interval(first))

    def _sampled_interval(self, first: int) -> str:
        """In ``sampled`` mode: the ops the first difference may be at (after the last op
        before ``first`` that both sides fingerprinted)."""
        if self.region.values != "sampled":
            return ""
        forward = self.region.ops
        start = next((i + 1 for i in range(first - 1, -1, -1)
                      if forward[i].fingerprint is not None
                      and self.ops[i].fingerprint is not None), 0)
        stop = "" if self.region.stop is None else f", the recompute's known stop #{self.region.stop}"
        return (f" (values sampled: every {self.region.stats.sample_every}th op{stop} and each "
                f"side's last are fingerprinted; the first difference is at one of ops "
                f"#{start} to #{first})")

    def _first_different_values(self, upto: int | None) -> tuple[int | None, int]:
        forward = self.region.ops
        n = min(len(self.ops), len(forward), len(self.ops) if upto is None else upto)
        first_inexact = next((i for i in range(n) if forward[i].inexact), n)
        groups: dict = {}
        for i in range(n):
            f, r = forward[i].fingerprint, self.ops[i].fingerprint
            if f is None or r is None or len(f) != len(r) or f[0].device != r[0].device:
                continue
            groups.setdefault(f[0].device, []).append(i)
        first = None
        for device, indices in groups.items():
            fwd = torch.stack([p for i in indices for p in forward[i].fingerprint])
            rec = torch.stack([p for i in indices for p in self.ops[i].fingerprint])
            scale = []
            for i in indices:
                k = len(forward[i].fingerprint)
                scale += forward[i].scale if i >= first_inexact else [0.0] * k
            norms = fwd.reshape(-1, 2)[:, 1].repeat_interleave(2)
            tol = torch.tensor(scale, dtype=torch.float64, device=device) * norms
            same = (fwd == rec) | ((fwd - rec).abs() <= tol) | (fwd.isnan() & rec.isnan())
            if not bool(same.all()):  # the one host synchronisation of this device
                entry = int((~same).nonzero()[0])
                offsets = [0]
                for i in indices:
                    offsets.append(offsets[-1] + len(forward[i].fingerprint))
                op_index = indices[next(j for j in range(len(indices)) if offsets[j + 1] > entry)]
                first = op_index if first is None else min(first, op_index)
        return first, first_inexact

    def _raise(self, what: str, position: int, theirs: OpRecord | None, detail: str):
        mine = self.ops[position] if position < len(self.ops) else None
        forward_site = format_site(theirs.site) if theirs else ()
        recompute_site = format_site(mine.site) if mine else ()
        op = str(mine.op if mine else theirs.op)
        raise RecomputeMismatchError(
            f"recompute of checkpointed region {self.region.name()} differs from its forward "
            f"at op #{position} ({what}): {detail}. Forward op at "
            f"{describe_site(forward_site)}; recompute op at {describe_site(recompute_site)}. "
            "The recompute is not replaying the forward (state changed between them, a lost "
            "mesh skipping a collective, an RNG state not restored), so gradients would be "
            "computed from other activations than the loss was.",
            region=self.region.name(), what=what, position=position, op=op,
            forward_site=forward_site, recompute_site=recompute_site)

    def _raise_side_effect(self, func, name: str, tensor: torch.Tensor, site: tuple):
        position = len(self.ops)
        forward = self.region.ops
        theirs = forward[position] if position < len(forward) else None
        forward_site = format_site(theirs.site) if theirs else ()
        recompute_site = format_site(site)
        raise RecomputeMismatchError(
            f"recompute of checkpointed region {self.region.name()} differs from its forward "
            f"at op #{position} (side effect): {func} writes its argument {name!r} (shape {list(tensor.shape)}, "
            f"{str(tensor.dtype).removeprefix('torch.')}), a tensor that lives outside the "
            f"region (a module buffer, parameter or attribute), so the forward's update would "
            f"be applied a second time. Forward op at {describe_site(forward_site)}; recompute "
            f"op at {describe_site(recompute_site)}. Keep the update out of the checkpointed "
            "region, or capture that state per region (fixes.recompute.state_preserving_"
            "context_fn / state_preserving).",
            region=self.region.name(), what="side effect", position=position, op=str(func),
            forward_site=forward_site, recompute_site=recompute_site)


def _pairs(values: list[float]) -> str:
    return ", ".join(f"({values[i]:.9g}, {values[i + 1]:.9g})" for i in range(0, len(values), 2))
