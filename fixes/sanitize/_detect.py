"""The detect tier of ``recompute_sanitizer()``: whether a checkpointed region's recompute made
something else than its forward where backward uses it, found without intercepting any op (no
dispatch mode: a region costs a few hooks, a fingerprint per side and version-counter reads).

Per region (a ``Watch``):

* what backward uses of each side: the tensors it saves for backward (non-reentrant; a pack
  hook stacked on the checkpoint's own records them, they are fingerprinted when the side
  ends -- a tensor written after its pack, as ``nn.RReLU``'s noise, is fingerprinted as the
  side left it) or its outputs (reentrant: the forward runs without grad and saves nothing);
  compared by count, metadata and, when the region is printed (``all``: every region;
  ``sampled``: every k-th region of a call site, rotating; ``none``: none), by fingerprint
  (``_fused``: a hash of each element's bits with its position, one kernel per side and
  device, one host synchronisation per device after the backward);
* writes outside the region by the recompute: the tensors the region reaches (its inputs, and
  the parameters, buffers and tensor attributes of the modules its function and arguments
  hold, narrowed to those its forward ran: ``_ran``, ``_reach.narrowed``; in ``sampled``
  and ``none`` the record of a recent region of the same identity, ``_reach.Walks.ran``; in
  ``all`` each forward's own record, narrowed as the identity's last one was where both list
  the same live modules, ``_reach._Plan``) -- small
  non-parameter ones by their contents before and after (batch norm updates its running
  statistics without bumping their version counter) -- but a value rebound since its
  module's last scan and a small argument made anew for each call (told by its storage,
  ``Walks._rebound_arguments``) -- the others by version counter
  (``_reach``: the walk of the modules is kept while no parameter, buffer or module is
  registered, for at most ``REWALK_ROUNDS`` steps; in ``all`` checked once a step against the
  modules' attributes -- by their dicts' version tags where CPython has them
  (``_dictversion``), else by identity -- so it finds what a fresh walk would; in the other modes a
  module is scanned again when a tensor found in it is freed).

Not seen: state the region does not reach that way (a global tracker, a tensor behind an
object that is no module, a submodule's state read without calling it while other
submodules of the same module held by the region ran -- megatron's block's other layers --
or a module only the recompute runs, on other control flow than its forward's), a rebound
Python attribute, state outside tensors (a communicator handle, a Python counter), a write
the recompute causes after it ends (a hook it registers that fires later in the backward:
each region is judged by what its recompute left when it ended, so a later region's write or
the backward's own is not taken for it) -- unless its effect reaches the saved tensors or
outputs, where it is caught. Writes inside ``recompute_may_differ`` blocks are not told apart
from the region's own (the locator, ``_region``, tells them apart).

When a recompute differs, ``values="all"`` locates it on the call site's next recompute: the
region at the same position among that call site's regions in the next round (forwards after
a backward) records its op stream (``_region``) and its error names the first diverging op
and both call sites; a divergence that does not recur there (or a program that never runs the
region again) raises the detection's own error, unlocated. ``sampled`` and ``none`` raise the
unlocated error at once.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from dataclasses import dataclass, field

import torch

from fixes.sanitize import _fingerprint as fp
from fixes.sanitize import _fused, _intended
from fixes.sanitize._callsite import describe_site
from fixes.sanitize._errors import Verdict
from fixes.sanitize._ran import ModulesRun, function_identity
from fixes.sanitize._reach import _CALL, Reached, State, Walks, reached, tensor_name

__all__ = ["Detection", "Watch"]

_METADATA = operator.attrgetter("shape", "dtype", "device")


@dataclass(slots=True)
class Detection:
    """What a recompute made differently: ``verdict``, which one (``item``) and how."""

    region: str
    site: tuple[str, ...]
    verdict: Verdict
    item: str
    detail: str
    # other bits, within the tolerance of a grad-mode-dependent lowering or CUDA atomics: an
    # error only where the locator finds the first differing op to be no such thing
    within_tolerance: bool = False
    # a write outside the region by a recompute that ran a declared block: an error only
    # where the locator (which tells the declared writes apart) finds one
    declared: bool = False
    # torch's checkpoint or autograd fails on it (another count or metadata): raised at once
    fatal: bool = False


# -- one side ----------------------------------------------------------------------------------


def _valued(t: torch.Tensor, cuda: bool) -> bool:
    """Values compared: not a 0-d integer tensor of a side that computes on CUDA (``cuda``):
    fused attention's philox seed and offset, drawn anew by a recompute with no effect when
    dropout is off -- on the GPU, or on the host (torch 2.11's flash attention on the H200
    saves them as uninitialised 0-d int64 CPU tensors when dropout is off: a false positive
    on every CUDA SDPA region until this rule took the host ones too)."""
    return not (t.dim() == 0 and not t.is_floating_point() and not t.is_complex()
                and (cuda or t.device.type == "cuda"))


@dataclass(slots=True)
class _Side:
    metas: list = field(default_factory=list)
    printed: _fused.Side | None = None  # the fingerprints, as the kernel left them
    # tolerant prints too (reentrant outputs, CUDA without determinism)
    tolerant: bool = False
    _prints: tuple | None = None

    def _made(self) -> tuple:
        if self._prints is None:  # only for a side found different (``_fused.Side``)
            self._prints = (self.printed.prints() if self.printed is not None
                            else (None, None))
        return self._prints

    @property
    def prints(self) -> list | None:
        return self._made()[0]

    @property
    def loose(self) -> list | None:
        return self._made()[1]


def _side(tensors: list[torch.Tensor], printed: bool, tolerant: bool) -> _Side:
    side = _Side(list(map(_METADATA, tensors)), tolerant=tolerant)  # compared whole
    if printed:  # one kernel per device (``_fused``)
        cuda = any(t.device.type == "cuda" for t in tensors)
        side.printed = _fused.side_prints(
            [t if _valued(t, cuda) else None for t in tensors], tolerant)
    return side


def _tolerant(tensors: list[torch.Tensor], reentrant: bool) -> bool:
    """Compared within ``ATOMIC_RTOL`` too: a reentrant region's outputs (its forward runs
    without grad, its recompute with: ``torch.matmul`` lowers differently, ``_intended``), and
    anything on CUDA unless deterministic algorithms are on (atomics)."""
    if reentrant:
        return True
    return (not torch.are_deterministic_algorithms_enabled()
            and any(t.device.type == "cuda" for t in tensors))


class _Packs:
    """The tensors packed for backward while entered, by a pack hook stacked on the
    checkpoint's own (None pushed when there is none: the region is not checkpointed here)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self._pushed = False

    def __enter__(self):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None:
            pack, unpack = top
            tensors = self.tensors

            # functools.wraps: code that asks which hook is on top (fixes.torchtitan's nested
            # checkpoint check) sees the checkpoint's.
            @functools.wraps(pack)
            def watched_pack(x):
                tensors.append(x)
                return pack(x)

            torch._C._autograd._push_saved_tensors_default_hooks(watched_pack, unpack)
            self._pushed = True
        return self

    def __exit__(self, *exc):
        if self._pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._pushed = False
            # Each saved variable keeps the hooks it was packed with, so the pack hook's list
            # must not keep the tensors: emptied, its contents handed over.
            self.tensors, held = list(self.tensors), self.tensors
            held.clear()
        return False


class Watch:
    """One call of a checkpoint in the detect tier: its forward's prints, and each recompute
    compared with them. ``found(detection)`` is the sanitizer's: it raises, or arms the
    locator."""

    def __init__(self, kind: str, label: str, site: tuple[str, ...], stats, roots,
                 reentrant: bool, printed: bool, found, walks: Walks | None = None,
                 fresh: bool = True, modules_run: ModulesRun | None = None,
                 ran_key: tuple | None = None):
        self.kind, self.label, self.site, self.stats = kind, label, site, stats
        self.reentrant, self.printed, self.found = reentrant, printed, found
        self._walks, self._fresh = walks, fresh  # see _reach.Walks
        self._roots = [weakref.ref(r) if _weakable(r) else r for r in roots]
        # the modules its forward ran (``_ran``): what it reaches is narrowed to them. Held
        # weakly: one built inside the forward (and its tensors) goes when the forward ends
        self._modules_run = modules_run
        self._ran: list[weakref.ref] | None = None
        # its identity (``_ran.identity``): the modules recorded for it lately are taken
        # (``Walks.ran``) instead of recording them again -- ``all`` records each forward and
        # takes the identity's plan of what it reaches (``_reach._Plan``); None: neither
        self._ran_key = ran_key if walks is not None else None
        self.forward: _Side | None = None
        self.broken: str | None = None
        self.judged_outside = False
        self._state: State | None = None
        self._recompute: tuple | None = None  # (tensors, stopped early) awaiting the verdict
        self.position = 0  # among its call site's regions in this round (the sanitizer's)

    def name(self) -> str:
        return f"{self.label} ({self.kind}, checkpointed at {describe_site(self.site)})"

    def _live_roots(self) -> list:
        roots = [r() if isinstance(r, weakref.ref) else r for r in self._roots]
        return [r for r in roots if r is not None]

    def ran(self) -> list[torch.nn.Module] | None:
        """The modules its forward ran, still alive (None: not recorded)."""
        if self._ran is None:
            return None
        return [m for m in map(_CALL, self._ran) if m is not None]

    def reached(self) -> Reached | list[torch.Tensor]:
        roots = self._live_roots()
        if self._walks is None:
            return reached(roots, self.ran())
        key = self._ran_key  # (call site, position, ``identity(fn, args)``), read at the call
        # What it reaches is found at the recompute. Where the function's closure changed
        # since its call -- a cell rebound, a tensor put into a container the identity read by
        # value -- it is not that identity now: found again, not taken from the identity's
        # plan or argument slots (a review of 912530d: a tensor put into the closure's list
        # after the call was missed in every mode)
        if key is not None and (not roots or function_identity(roots[0]) != key[2][0]):
            key = None
        return self._walks.reach(roots, self._fresh, self.ran, key, self._ran)

    def _new_state(self) -> State | None:
        """What it reaches, as the recompute about to run finds it; None where finding it
        failed: the sanitizer's own failure (a warning naming it, the region unchecked), never
        an error out of the user's backward."""
        try:
            return State(self.reached())
        except Exception as exc:
            self._fail(exc)
            return None

    def _recording_modules(self):
        """A context recording the modules the forward runs (``_ran``), or none."""
        if self._modules_run is None:
            return contextlib.nullcontext([])
        if self._ran_key is not None and not self._fresh:  # ``all``: each forward records
            kept = self._walks.ran(self._ran_key)
            if kept is not None:
                self._ran = kept
                return contextlib.nullcontext(None)
        return self._modules_run.recording()

    def _ran_these(self, modules: list[torch.nn.Module] | None) -> None:
        """The forward's record (None: taken from the last one of its identity)."""
        if self._modules_run is not None and modules is not None:
            self._ran = list(map(weakref.ref, modules))
            if self._ran_key is not None and not self._fresh:  # ``all``: ``Walks.reach`` keeps it
                self._walks.keep_ran(self._ran_key, self._ran)

    # -- non-reentrant -------------------------------------------------------------------------

    def recording(self, entry=None):
        self.stats.regions += 1
        return _Recording(self)

    def replaying(self, fn):
        def recompute_function(*args, **kwargs):
            if not self.judged_outside:
                self._state = self._new_state()
            packs = _Packs()
            failed = stopped = False
            try:
                with packs:
                    return fn(*args, **kwargs)
            except BaseException as exc:
                stopped = type(exc).__name__ == "_StopRecomputationError"
                failed = not stopped
                raise
            finally:
                self._recompute = None if failed else (packs.tensors, stopped)
                del packs
                if not self.judged_outside:  # judged here, inside the recompute's contexts
                    self._judge_saved()

        recompute_function.__wrapped__ = fn
        return recompute_function

    def judging(self, recompute_fn):
        self.judged_outside = True

        def judged_recompute(*args):
            self._state = self._new_state()
            stop = None
            try:
                recompute_fn(*args)
            except BaseException as exc:
                if type(exc).__name__ != "_StopRecomputationError":
                    self._recompute = self._state = None
                    raise
                stop = exc
            try:
                self._judge_saved()
            except BaseException:
                stop = None  # (see below) the error must not keep the stopped recompute either
                raise
            if stop is not None:
                try:  # no local left holding the exception whose traceback holds this frame
                    raise stop
                finally:
                    stop = None

        judged_recompute.__wrapped__ = recompute_fn
        return judged_recompute

    def _judge_saved(self) -> None:
        pending, self._recompute = self._recompute, None
        state, self._state = self._state, None
        if pending is None or self.forward is None or self.broken is not None:
            return
        tensors, stopped = pending
        self.stats.recomputes += 1
        self.stats.recomputed(self.site)
        self._judge(tensors, state, stopped)

    # -- reentrant -----------------------------------------------------------------------------

    def function(self, fn):
        """``fn`` as a reentrant checkpoint calls it: the first call is the forward, every later
        call a recompute."""

        def region_function(*args, **kwargs):
            if self.forward is None:
                self.stats.regions += 1
                with self._recording_modules() as ran:
                    out = fn(*args, **kwargs)
                self._ran_these(ran)
                self._finish_forward(fp.tensors(out))
                return out
            self.stats.recomputes += 1
            self.stats.recomputed(self.site)
            state = self._new_state()
            out = fn(*args, **kwargs)
            if self.broken is None:  # else the sanitizer's own failure: unchecked
                self._judge(fp.tensors(out), state, False)
            return out

        region_function.__wrapped__ = fn
        return region_function

    # -- the verdict ---------------------------------------------------------------------------

    def _finish_forward(self, tensors: list[torch.Tensor]) -> None:
        try:
            self.forward = _side(tensors, self.printed, _tolerant(tensors, self.reentrant))
            self.stats.fingerprints += len(tensors) if self.printed else 0
        except Exception as exc:  # the sanitizer's own failure: the region runs unchecked
            self._fail(exc)

    def _judge(self, tensors: list[torch.Tensor], state: State | None, stopped: bool) -> None:
        """Count and metadata now (host-side: a difference torch fails on is raised at once);
        values and outside state queued, judged with every other recompute of this backward
        after one synchronisation per device (``RecomputeSanitizer.defer``)."""
        try:
            found, recompute = self._shape_difference(tensors, stopped)
        except Exception as exc:
            self._fail(exc)
            return
        if found is not None:
            self.found(self, found)
            return
        if state is not None:
            try:  # it copies (allocates, mid-backward): a failure there is the sanitizer's
                state.settle()
            except Exception as exc:
                self._fail(exc)
                return
        self.stats.defer(_Check(self, recompute, state))

    def _shape_difference(self, tensors, stopped) -> tuple[Detection | None, _Side | None]:
        forward = self.forward
        n_f, n_r = len(forward.metas), len(tensors)
        if self.reentrant:
            self.stats.outputs_compared += n_r
        else:
            self.stats.saved_compared += n_r
        noun = "output" if self.reentrant else "saved tensor"
        if n_r != n_f and (self.reentrant or (n_r < n_f and not stopped)):
            verdict = Verdict.OUTPUT if self.reentrant else Verdict.SAVED_COUNT
            return Detection(self.name(), self.site, verdict, f"the {noun}s",
                             f"the forward made {n_f} {noun}s, the recompute {n_r}",
                             fatal=True), None
        if n_r > n_f:
            tensors = tensors[:n_f]
        recompute = _side(tensors, self.printed, forward.tolerant)
        if self.printed:
            self.stats.fingerprints += len(tensors)
        if recompute.metas != forward.metas[:len(recompute.metas)]:  # one comparison: equal
            for i, (a, b) in enumerate(zip(forward.metas, recompute.metas, strict=False)):
                if a != b:
                    what = Verdict.OUTPUT if self.reentrant else Verdict.SAVED_TENSOR
                    return Detection(self.name(), self.site, what, f"{noun} #{i} of {n_f}",
                                     f"forward {_meta(a)}, recompute {_meta(b)}",
                                     fatal=True), None
        return None, recompute

    def _value_difference(self, recompute: _Side, state: State | None,
                          given_back: set[int] | None = None) -> Detection | None:
        """``given_back``: the ids of the tensors an earlier recompute of the same backward
        gave its contents back (theirs from before the first write: kept)."""
        forward = self.forward
        what = Verdict.OUTPUT if self.reentrant else Verdict.SAVED_TENSOR
        noun = "output" if self.reentrant else "saved tensor"
        changed = state.changed() if state is not None else []
        if changed:
            self.stats.outside_writes += len(changed)
            t, before = changed[0]
            # the blocks entered while its recompute ran (not a later region's)
            ended = state.declared if state.declared is not None else _intended.entered()
            declared = ended != state.declarations
            restored = False
            if before is not None and not declared:  # its contents from before, back
                for u, c in changed:
                    if c is None:
                        continue
                    if given_back is not None and id(u) in given_back:
                        restored = True  # an earlier recompute's before: this one's held its write
                    elif State.restore(u, c):
                        restored = True
                        if given_back is not None:
                            given_back.add(id(u))
            shape = f"shape {list(t.shape)}, {str(t.dtype).removeprefix('torch.')}"
            where = tensor_name(t, self._live_roots())
            shape = f"{where}, {shape}" if where else shape
            more = f"; {len(changed) - 1} more such tensors" if len(changed) > 1 else ""
            return Detection(self.name(), self.site, Verdict.SIDE_EFFECT,
                             f"a tensor outside the region ({shape})",
                             "the recompute leaves a tensor the region reaches (a module "
                             "buffer, parameter, attribute or the region's input) changed, so "
                             "the forward's update would be applied a second time" +
                             (" (the sanitizer gave it its contents back)"
                              if restored else "") + more,
                             declared=declared)
        if not self.printed:
            return None
        pairs = _pairs(forward.prints, recompute.prints)
        index = fp.first_different(pairs)
        within = False
        if index is not None and forward.tolerant:
            loose = _pairs(forward.loose, recompute.loose)
            within = (beyond := fp.first_different(loose)) is None
            index = index if within else beyond
        if index is None:
            return None
        n_f = len(forward.metas)
        return Detection(self.name(), self.site, what,
                         f"{noun} #{index} of {n_f} ({_meta(forward.metas[index])[1:-1]})",
                         f"other values: forward {fp.describe(pairs[index][0])}, recompute "
                         f"{fp.describe(pairs[index][1])}" +
                         (" (other bits, within the tolerance of a lowering or atomics)"
                          if within else ""), within_tolerance=within)

    def _fail(self, exc: BaseException) -> None:
        import warnings

        from fixes.sanitize._errors import RecomputeSanitizerWarning

        if self.broken is not None:
            return
        self.broken = f"{type(exc).__name__}: {exc}"
        self.stats.internal_errors.append(f"{self.name()}: {self.broken}")
        warnings.warn(f"recompute_sanitizer could not check checkpointed region {self.name()} "
                      f"(its own failure, not the region's): {self.broken}; the region runs "
                      "unchecked", RecomputeSanitizerWarning, stacklevel=3)


def _pairs(forward: list, recompute: list) -> list:
    """Print pairs; a tensor unreadable when one side ended (a parameter FSDP2 resharded, a
    storage a reclaim released) is compared by metadata only."""
    return [(a, b) if a is not None and b is not None else (None, None)
            for a, b in zip(forward, recompute, strict=False)]


class _Check:
    """One recompute's values and outside state, judged after the backward's one
    synchronisation: ``print_columns()`` and the small state's flags are device tensors, set
    where something may differ; ``host_changed`` is known without a synchronisation (version
    counters)."""

    def __init__(self, watch: Watch, recompute: _Side, state: State | None):
        self.watch, self.recompute, self.state = watch, recompute, state

    def host_changed(self) -> bool:
        return self.state is not None and self.state.host_changed()

    def print_columns(self) -> list[tuple]:
        """``(device, forward's, recompute's)`` exact prints to compare (``_fused.columns``;
        the sanitizer compares every check of the backward in one op per device)."""
        forward = self.watch.forward
        if not self.watch.printed or forward is None or forward.printed is None \
                or self.recompute.printed is None:
            return []
        return _fused.columns(forward.printed, self.recompute.printed)

    def finish(self, given_back: set[int] | None = None) -> None:
        """Judge it in full (a suspect); ``given_back`` as ``Watch._value_difference``'s,
        shared by a backward's checks judged in the order they were recomputed."""
        watch = self.watch
        try:
            found = watch._value_difference(self.recompute, self.state, given_back)
        except Exception as exc:
            watch._fail(exc)
            return
        if found is not None:
            watch.found(watch, found)


class _Recording:
    """A non-reentrant region's forward (a context manager)."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self.packs = _Packs()
        self.modules = watch._recording_modules()

    def __enter__(self):
        self.packs.__enter__()
        self.ran = self.modules.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.modules.__exit__(exc_type, exc, tb)
        self.packs.__exit__()
        tensors, self.packs = self.packs.tensors, None
        if exc_type is None:
            self.watch._ran_these(self.ran)
            self.watch._finish_forward(tensors)
        return False


def _meta(m) -> str:
    shape, dtype, device = m
    return f"({list(shape)}, {str(dtype).removeprefix('torch.')}, {device})"


def _weakable(obj) -> bool:
    return isinstance(obj, (torch.Tensor, torch.nn.Module))
