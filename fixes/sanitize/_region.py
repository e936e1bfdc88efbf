"""The locator of ``recompute_sanitizer(values="all")``: one checkpointed region whose earlier
round the detect tier (``_detect``) found different, recorded in full -- its forward and each of
its recomputes, each side recorded by a dispatch mode entered innermost inside the region (a
selective-AC mode, or torch_remat's, that serves saved outputs in the recompute sees the ops
after this one, in the forward and the recompute alike).

Each side records what backward may use of it -- the tensors it saves for backward
(``_saved``; non-reentrant regions) or its outputs (reentrant ones) -- its writes into tensors
outside the region (a recompute's: ``_outside``), and its op stream (``_stream``). When a
recompute ends (also when it stops early, after its last saved tensor) the verdict
(``_verdict``) compares it with its forward and raises ``RecomputeMismatchError`` if backward
would use something the recompute made differently, located in the op streams.

In ``none`` mode a side keeps no op stream: an op that writes none of its arguments is passed
on with nothing recorded (a recompute notes the storages it makes), and only writing ops are
classified -- for writes outside the region (a recompute) and ``update`` declarations (a
forward). ``declared_ops`` then counts declared writing ops only.

Ops are counted without autograd's detaches, allocations (``_fingerprint.ALLOCATIONS``: whether
a cache allocates depends on its state, not on the region), the ops of the checkpoint's own
hooks and of ``fixes.recompute`` (``_opsite``), and the ops of declared intended differences
(``_intended``).

Never the user's failure: an exception of the sanitizer's own while it records or compares a
region is caught, the region is left unchecked with a ``RecomputeSanitizerWarning`` naming
the reason, and the user's forward and backward run on as without the sanitizer.
"""

from __future__ import annotations

import types
import warnings

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from fixes.recompute import state as recompute_state
from fixes.sanitize import _fingerprint as fp
from fixes.sanitize import _intended, _opsite, _verdict
from fixes.sanitize._callsite import describe_site
from fixes.sanitize._errors import (
    RecomputeMismatchError,
    RecomputeSanitizerWarning,
    unlocated_error,
)
from fixes.sanitize._modes import Values
from fixes.sanitize._opsite import raw_site
from fixes.sanitize._outside import OutsideWrites
from fixes.sanitize._saved import SavedTensors
from fixes.sanitize._stream import OpStream, info

__all__ = ["RecomputeMismatchError", "Region"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _subclass_dispatch(types_):
    """NotImplemented to let a wrapper subclass (DTensor) unwrap first; a marker for fake /
    functional tensors (no real values: passed through); None for plain tensors."""
    for t in types_:
        if t not in _PLAIN:
            return NotImplemented if is_traceable_wrapper_subclass_type(t) else "pass"
    return None


class _SideMode(TorchDispatchMode):
    """A side's dispatch mode: subclass dispatch passes through; every other op runs through
    its side's ``before`` and ``after``, which never raise (``none``: only ops that write an
    argument do; the others pass through, a recompute noting the storages they make)."""

    def __init__(self, side: _Side):
        super().__init__()
        self.side = side

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (special := _subclass_dispatch(types_)) is not None:
            return special if special is NotImplemented else func(*args, **kwargs)
        side = self.side
        if side.region.broken is not None:
            return func(*args, **kwargs)
        op = info(func)
        if side.light and not op.written:  # ``none``: only writes are looked at (below)
            out = func(*args, **kwargs)
            if side.tracks_created:
                try:
                    side.created(op, fp.tensors(out))
                except Exception as exc:
                    side.fail(exc)
            return out
        try:
            site, declared = side.classify(func, op)
            held = side.before(func, op, args, kwargs, site, declared) if op.written else None
        except Exception as exc:  # the sanitizer's own failure
            side.fail(exc)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            side.after(func, op, out, site, declared, held)
        except Exception as exc:
            side.fail(exc)
        return out


class _Side:
    """What one side of a region (its forward, or one recompute) ran and saved."""

    forward_side = True
    tracks_created = False  # ``none``: a recompute still tells the tensors it made from others

    def __init__(self, region: Region):
        self.region = region
        mode = region.values
        # ``none`` keeps no op stream: the verdict (metadata, writes outside the region) needs
        # none, and an op no one writes is passed on with nothing recorded (issue 34: the
        # per-op records were most of this mode's cost, to locate what it rarely finds)
        self.light = mode is Values.NONE
        self.stream = OpStream(mode, region.stats.sample_every)
        self.saved = SavedTensors(self.stream, self.forward_side, self.fail,
                                  len(region.forward.saved.entries)
                                  if region.forward is not None else 0)
        self.outputs: list[tuple] = []
        # storages of tensors this side's ops made: a recompute's writes into others are
        # outside writes; a view of one is not fingerprinted in the op stream (its values are
        # those of an op of the stream), a view of another (a weight's transpose) is
        self._created: set[int] = set()
        self.sampled = mode is Values.SAMPLED
        self.entry = None  # a non-reentrant forward: the frame its region was entered from
        self._mode = _SideMode(self)

    def __enter__(self):
        self._mode.__enter__()
        if not self.region.reentrant:
            self.saved.__enter__()
        return self

    def _leave(self, exc_type, exc, tb) -> None:
        if not self.region.reentrant:
            self.saved.__exit__(exc_type, exc, tb)
        self._mode.__exit__(exc_type, exc, tb)

    # -- per op -------------------------------------------------------------------------------

    def classify(self, func, op) -> tuple[tuple | None, _intended.Declaration | None]:
        """The op's raw call site (None: not part of the op stream) and the declaration it
        runs under, if any."""
        declared = _intended.current()
        if declared is not None or op.skipped or op.unrecorded:
            return None, declared
        site = raw_site(self.region.opaque, entry=self.entry)
        if isinstance(site, _intended.Declaration):
            return None, site
        return site, None

    def before(self, func, op, args, kwargs, site, declared):
        return None

    def after(self, func, op, out, site, declared, held) -> None:
        outs = fp.tensors(out)
        self.created(op, outs)
        if site is None:
            if declared is not None:
                self.region.stats.declared_ops += 1
            return
        if not self.light:
            self.stream.add(func, outs, op, site,
                            inner=op.view and all(_storage_key(t) in self._created for t in outs))

    def created(self, op, outs) -> None:
        for fresh, t in zip(op.fresh, outs, strict=False):
            if fresh and t.layout is torch.strided and not t.is_meta:
                self._created.add(t.untyped_storage()._cdata)

    def set_outputs(self, out) -> None:
        """A reentrant side's outputs: metadata and, unless the mode is ``none``, the exact and
        the tolerant print of each (the tolerant one for a grad-mode-dependent lowering:
        ``_intended.LOWERING_OPS``)."""
        printed = self.stream.mode is not Values.NONE
        self.outputs = [(fp.metadata([t]),
                         fp.fingerprint([t], tolerant=self.stream.tolerant) if printed else None,
                         fp.fingerprint([t], tolerant=True) if printed else None)
                        for t in fp.tensors(out)]

    def fail(self, exc: BaseException) -> None:
        if self.region.broken is not None:
            return
        reason = f"{type(exc).__name__}: {exc}"
        self.region.broken = reason
        self.region.stats.internal_errors.append(f"{self.region.name()}: {reason}")
        warnings.warn(f"recompute_sanitizer could not check checkpointed region "
                      f"{self.region.name()} (its own failure, not the region's): {reason}; "
                      "the region runs unchecked", RecomputeSanitizerWarning, stacklevel=2)


class Forward(_Side):
    """A region's forward, recorded (a context manager)."""

    def __init__(self, region: Region):
        super().__init__(region)
        self.updates: set = set()  # ``update`` declarations the forward wrote under

    def before(self, func, op, args, kwargs, site, declared):
        if declared is not None and declared.writes is _intended.Writes.UPDATE:
            self.updates.add(declared)
        if not self.saved.by_storage:
            return None
        keys = [k for t in _written_tensors(op, args, kwargs) if (k := _storage_key(t)) is not None]
        return self.saved.written(keys) or None

    def after(self, func, op, out, site, declared, held) -> None:
        super().after(func, op, out, site, declared, held)
        if held:
            recorded = site is not None
            self.saved.rewritten(held, len(self.stream.records) - 1 if recorded else None)

    def __exit__(self, exc_type, exc, tb):
        self._leave(exc_type, exc, tb)
        self._created.clear()
        self.entry = None  # the caller's frame is not kept past the forward
        if exc_type is None and self.region.broken is None:
            try:
                self.saved.finish()  # first: it may reuse the op stream's prints
                self.stream.finish()
                self.region.stats.fingerprints += self.stream.fingerprints
            except Exception as failure:
                self.fail(failure)
        return False


class Replay(_Side):
    """One recompute of a region, judged against its forward when it ends (a context manager)."""

    forward_side = False
    tracks_created = True

    def __init__(self, region: Region):
        super().__init__(region)
        self.outside = OutsideWrites()
        self.stopped_early = False

    def __enter__(self):
        self.region.stats.recomputes += 1
        return super().__enter__()

    def before(self, func, op, args, kwargs, site, declared):
        if declared is not None and declared.writes is _intended.Writes.SCRATCH:
            return None
        if site is None and declared is None:
            return None  # machinery (a checkpoint hook, fixes.recompute): not the region's
        managed = None
        for name, t in _written_arguments(op, args, kwargs):
            key = _storage_key(t)
            if key is None or key in self._created:
                continue
            managed = recompute_state.managed_storages() if managed is None else managed
            if key in managed:
                continue
            if _intended.scratch_reason(key) is not None:
                self.region.stats.scratch_writes += 1
                continue
            if site is None:  # a declared write: its own site, for a report
                found = raw_site(self.region.opaque, declared=False)
                site = found if isinstance(found, tuple) else ()
            self.region.stats.outside_writes += 1
            self.outside.before_write(func, t, name, len(self.stream.records), site, declared)
        return None

    def __exit__(self, exc_type, exc, tb):
        self._leave(exc_type, exc, tb)
        self._created.clear()
        self.stopped_early = (exc_type is not None
                              and exc_type.__name__ == "_StopRecomputationError")
        if exc_type is not None and not self.stopped_early:
            return False  # the recompute failed by itself: that error is the news
        if self.region.judged_outside:
            self.region.pending = self  # judged once the recompute's contexts have exited
            return False
        self.judge()
        return False

    def judge(self) -> None:
        """Compare with the forward; raise ``RecomputeMismatchError`` on a difference."""
        region, forward = self.region, self.region.forward
        if region.broken is not None or forward is None:
            return
        try:
            self.saved.finish()  # first: it may reuse the op stream's prints
            self.stream.finish()
            stats = region.stats
            stats.ops_compared += len(self.stream.records)
            stats.fingerprints += self.stream.fingerprints
            stats.saved_compared += len(self.saved.entries)
            stats.saved_fingerprints += sum(e.print is not None for e in self.saved.entries)
            stats.outputs_compared += len(self.outputs)
            finding = _verdict.judge(forward, self)
        except Exception as failure:
            self.fail(failure)
            return
        if finding is not None:
            _verdict.raise_for(finding, region, forward, self)
        if region.detection is not None:
            found, region.detection = region.detection, None
            if found.declared or found.within_tolerance:
                # the locator told the declared writes apart, or found a lowering: no error,
                # and this region's like differences are accepted from now on
                region.stats._tolerated.add((region.site[:1], region.position))
                return
            raise unlocated_error(
                found, "the divergence did not recur on the next recompute of its call site, "
                "where the op stream was recorded")


def _storage_key(t) -> int | None:
    if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
        return t.untyped_storage()._cdata
    return None


def _written_arguments(op, args, kwargs):
    for index, name in op.written:
        value = args[index] if index < len(args) else kwargs.get(name)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                yield name, leaf


def _written_tensors(op, args, kwargs):
    return [t for _, t in _written_arguments(op, args, kwargs)]


class Region:
    """One call of a checkpoint: its forward, and the recomputes judged against it."""

    def __init__(self, kind: str, label: str, site: tuple[str, ...], stats,
                 opaque: bool = False, reentrant: bool = True):
        # stats: the RecomputeSanitizer (its values mode, sample_every and counters)
        self.kind, self.label, self.site, self.stats = kind, label, site, stats
        self.values = Values(stats.values)
        self.opaque = opaque  # a torch_remat region (see raw_site)
        self.reentrant = reentrant  # backward differentiates the recompute's outputs
        self.forward: Forward | None = None
        self.broken: str | None = None  # why the region is not checked (the sanitizer's own)
        # A non-reentrant recompute is judged after the checkpoint's recompute function
        # returns (``judging``): outside every context its context_fn entered, so that a
        # recompute context that restores state has restored it.
        self.judged_outside = False
        self.pending: Replay | None = None
        # the detect tier's finding this region locates (``recompute_sanitizer``'s locator)
        self.detection = None

    def name(self) -> str:
        return f"{self.label} ({self.kind}, checkpointed at {describe_site(self.site)})"

    def recording(self, entry=None) -> Forward:
        """The forward's side; ``entry``: the frame the region was entered from, where its
        ops' call sites end (a non-reentrant region: see ``_opsite.raw_site``)."""
        self.stats.regions += 1
        self.forward = Forward(self)
        self.forward.entry = entry
        return self.forward

    def replay(self) -> Replay:
        self.stats.recomputed(self.site)
        return Replay(self)

    def function(self, fn):
        """``fn`` as a reentrant checkpoint calls it: the first call is the forward (recorded),
        every later call a recompute (judged)."""

        def region_function(*args, **kwargs):
            side = self.recording() if self.forward is None else self.replay()
            with side:
                out = fn(*args, **kwargs)
                _guarded(side, side.set_outputs, out)
            return out

        region_function.__wrapped__ = fn
        return region_function

    def replaying(self, fn):
        """``fn`` as a non-reentrant checkpoint's recompute calls it: every call judged."""

        def recompute_function(*args, **kwargs):
            with self.replay():
                return fn(*args, **kwargs)

        recompute_function.__wrapped__ = fn
        return recompute_function

    def judging(self, recompute_fn):
        """The checkpoint frame's ``recompute_fn`` (which enters the recompute's contexts and
        calls ``replaying(fn)`` inside them), judging each recompute after it returns."""
        self.judged_outside = True

        def judged_recompute(*args):
            stop = None
            try:
                recompute_fn(*args)
            except BaseException as exc:
                if type(exc).__name__ != "_StopRecomputationError":
                    self.pending = None
                    raise
                stop = exc
            replay, self.pending = self.pending, None
            if replay is not None:
                try:
                    replay.judge()
                except BaseException:
                    stop = None  # (see below) the error must not keep the stopped recompute
                    raise
            if stop is not None:
                # The early stop re-raised without its own frame keeping it: a local that
                # holds the exception whose traceback holds this frame is a cycle, and the
                # stopped recompute's graph and tensors would wait for the cycle collector.
                try:
                    raise stop
                finally:
                    stop = replay = None

        judged_recompute.__wrapped__ = recompute_fn
        return judged_recompute


def _guarded(side: _Side, call, *args) -> None:
    if side.region.broken is not None:
        return
    try:
        call(*args)
    except Exception as exc:
        side.fail(exc)


# The frames that enter a region's code from the sanitizer (see _opsite.raw_site).
_opsite.BOUNDARIES.update(c for f in (Region.function, Region.replaying)
                          for c in f.__code__.co_consts if isinstance(c, types.CodeType))
