"""``recompute_sanitizer()``: a checkpointed region whose recompute computes something else
than its forward where backward uses it raises ``RecomputeMismatchError``, naming what differs
and where the recompute first departs from its forward.

Why: every silent failure of activation checkpointing is a recompute that computes something
else than the forward did, and autograd then backpropagates through those other activations:
the spmd mesh lost in the recompute skips torchtitan's collectives (verl #6950; at TP=2 the
gradients are wrong, no error), state that a later layer's forward overwrote (Megatron-LM #6793),
an effectful op run a second time (torchtitan #4568 / #4673), an RNG state not restored
(OLMo-core #828), an early-stopped recompute that never fills a saved tensor (pytorch#193671).
``torch.utils.checkpoint(determinism_check="default")`` compares only shapes, dtypes and devices
of the tensors the recompute saves, and nothing covers megatron-core's reentrant checkpoint.

What is judged: what backward uses -- the tensors the forward saved for backward against the
recompute's (non-reentrant regions, matched as the checkpoint matches them), the region's
outputs (reentrant regions, whose forward runs without grad and saves nothing), and the tensors
the region reaches that a recompute leaves changed. The detect tier (``_detect``) judges every
region with no op intercepted; the op stream (``_region``, ``_verdict``) only locates: in
``values="all"`` a detection arms it for the region's next round, whose error names the first
diverging op and both call sites. Ops that differ while what backward uses is equal are no
error. Intended differences are declared where they are made
(``recompute_may_differ``, ``scratch_tensors``; megatron-core's no-grad aux loss and
``GlobalMemoryBuffer``, FSDP2's hooks and TransformerEngine's FP8 recompute are built in:
``_intended``).

What is wrapped while active (all put back on exit): the entry of each checkpoint
implementation, so that every region is seen whoever calls it --

* ``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` (non-reentrant
  ``checkpoint``, torch's ``checkpoint_wrapper``, torchtitan's AC, torch_remat, which replays
  through it);
* the same generator as ``torch.distributed._composable.checkpoint`` binds it (the composable
  ``checkpoint(module)``);
* ``torch.utils.checkpoint.CheckpointFunction.forward`` (``use_reentrant=True``);
* ``megatron.core.tensor_parallel.random.CheckpointFunction.forward`` and
  ``CheckpointWithoutOutput.checkpoint`` (megatron's selective recompute), also when
  megatron-core is imported while the sanitizer is active.

Also held while active: torch's global parameter, buffer and module registration hooks
(``_reach.Walks.watching``); and only while a region's forward runs, one global module
forward pre-hook recording the modules it runs (``_ran``: what the region reaches; in
``sampled`` and ``none`` only where the region's identity has no recent record).

Values are compared bitwise, or within ``ATOMIC_RTOL`` where the exact prints differ on CUDA
without deterministic algorithms or in a reentrant region's outputs (a lowering; in ``all``
the locator decides). Not seen: regions under ``torch.compile``, state the region does not
reach (``_detect``), state that is a Python value rather than a tensor (its effect on the
recomputed values is seen), and checkpoint implementations other than the ones above.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.utils.checkpoint as torch_checkpoint

from fixes.sanitize._callsite import ActiveSlot, call_site
from fixes.sanitize._detect import Detection, Watch
from fixes.sanitize._errors import (
    Divergence,
    RecomputeMismatchError,
    RecomputeSanitizerWarning,
    Verdict,
    never_recomputed_error,
    unlocated_error,
)
from fixes.sanitize._fingerprint import ATOMIC_RTOL
from fixes.sanitize._intended import recompute_may_differ, scratch_tensors
from fixes.sanitize._modes import VALUES, Values
from fixes.sanitize._on_import import OnImport
from fixes.sanitize._opsite import entry_frame
from fixes.sanitize._patch import _apply, _ApplyPatch, _checkpoint_frame, _Patch
from fixes.sanitize._ran import ModulesRun, identity
from fixes.sanitize._reach import Walks, any_changed, changed_flags, roots_of
from fixes.sanitize._region import Region

__all__ = ["ATOMIC_RTOL", "Divergence", "RecomputeMismatchError", "RecomputeSanitizer",
           "RecomputeSanitizerWarning", "Values", "Verdict", "recompute_may_differ",
           "recompute_sanitizer", "scratch_tensors"]

_MEGATRON = "megatron.core.tensor_parallel.random"
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def _has_megatron() -> bool:
    return importlib.util.find_spec("megatron") is not None


@dataclass
class RecomputeSanitizer:
    """What ``recompute_sanitizer()`` yields: its values mode, the checkpoint entries it wraps,
    and counts of what it checked: regions recorded, recomputes judged, ops in the recomputes'
    op streams (``ops_compared``), op-stream fingerprints (forward and recompute together),
    saved tensors and outputs compared (and the recomputes' saved tensors fingerprinted), writes outside the regions checked (and into scratch, not checked), ops left out by
    declared intended differences, and the sanitizer's own failures (each region it could not
    check, with the reason)."""

    values: str = "all"
    sample_every: int = 8
    wrapped: list[str] = field(default_factory=list)
    regions: int = 0
    recomputes: int = 0
    ops_compared: int = 0
    fingerprints: int = 0
    saved_compared: int = 0
    saved_fingerprints: int = 0  # of the recomputes' saved tensors
    outputs_compared: int = 0
    outside_writes: int = 0
    scratch_writes: int = 0  # writes into declared scratch (not checked)
    lowerings_accepted: int = 0  # reentrant outputs compared within the lowering tolerance
    declared_ops: int = 0
    internal_errors: list[str] = field(default_factory=list)
    detections: int = 0  # recomputes the detect tier found different
    # writes of recomputes that ran a declared block, left unjudged (no locator ran)
    declared_writes: int = 0
    located: int = 0  # regions the locator recorded (values="all", after a detection)
    # per call site: [position in the current round, a recompute ran since, rounds before]
    _sites: dict = field(default_factory=dict, repr=False)
    # (call site, position in its round) -> the detection its next region locates
    _armed: dict = field(default_factory=dict, repr=False)
    # (call site, position) whose within-tolerance difference the locator found a lowering
    _tolerated: set = field(default_factory=set, repr=False)
    _pending: list = field(default_factory=list, repr=False)  # checks awaiting the flush
    _queued_on: int = field(default=-1, repr=False)  # the backward whose flush is queued
    _walks: Walks = field(default_factory=Walks, repr=False)  # what regions reach, kept
    # the modules each region's forward runs (what it reaches is narrowed to them)
    _modules_run: ModulesRun = field(default_factory=ModulesRun, repr=False)
    # watch -> its fatal error, held for torch's own check of the recompute (_torch_check_first)
    _for_torch: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary,
                                                  repr=False)

    def _on(self) -> bool:
        return _slot.holds(self)

    @property
    def module_walks(self) -> int:
        """Fresh walks of the regions' modules (``_reach.Walks``: a walk is kept while it
        holds; ``all`` checks it once a step per set of modules)."""
        return self._walks.walked

    @property
    def modules_recorded(self) -> int:
        """Records of the modules a region's forward ran, kept (``_reach.Walks.ran``): in
        ``sampled`` and ``none`` one per region whose identity had no recent record; in
        ``all``, those a plan was made from."""
        return self._walks.recorded

    def region(self, kind: str, fn, opaque: bool = False, reentrant: bool = True,
               roots: list | None = None, args: tuple | None = None,
               kwargs: dict | None = None) -> Watch | Region:
        """The detect tier's ``Watch`` for a new region; the locator's ``Region`` (the op
        stream) for one at the call site and round position of an earlier detection.
        ``args`` (and ``kwargs``), the region's arguments, where given: in ``sampled`` and
        ``none`` a region of the same identity (``_ran.identity``: call site, position,
        function and plain arguments) recorded lately lends it the modules its forward ran
        (``Walks.ran``), in ``all`` its forward records them and takes the identity's plan of
        what it reaches where the two records list the same live modules (``_reach._Plan``);
        None: its forward records them, and what it reaches is found anew."""
        label = getattr(fn, "__qualname__", None) or type(fn).__name__
        site = call_site()
        key = site[:1]  # the line that checkpoints: its callers may differ from step to step
        count = self._sites.get(key)
        if count is None:
            count = self._sites[key] = [0, False, 0]
        if count[1]:  # a forward after a backward: a new round of this site's regions
            count[0], count[1] = 0, False
            count[2] += 1
        position, rounds = count[0], count[2]
        count[0] += 1
        found = self._armed.pop((key, position), None) if self._armed else None
        if found is not None:
            self.located += 1
            region = Region(kind, label, site, self, opaque, reentrant)
            region.detection, region.position = found, position
            return region
        fresh = self.values == "all"
        ran_key = None if args is None else (key, position, identity(fn, args, kwargs))
        watch = Watch(kind, label, site, self, roots if roots is not None else [fn],
                      reentrant, self._printed(position, rounds), self._found, self._walks,
                      fresh=fresh, modules_run=self._modules_run, ran_key=ran_key)
        watch.position = position
        return watch

    def defer(self, check) -> None:
        """Judge ``check`` (a ``_detect._Check``) when this backward ends, with every other
        recompute's, after one host synchronisation per device; at once outside backward."""
        self._pending.append(check)
        task = torch._C._current_graph_task_id()  # -1: not inside a backward
        if task == self._queued_on != -1:
            return  # this backward's flush is queued and has not run: it takes this check
        # One callback per backward (a backward that failed before its callbacks ran leaves
        # its checks to the next one's: task ids are never reused)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        except RuntimeError:  # not inside a backward
            self._flush()
        else:
            self._queued_on = task

    def _flush(self) -> None:
        # a check deferred after this flush (a recompute in a later final callback of the same
        # backward) queues a flush of its own
        self._queued_on = -1
        pending, self._pending = self._pending, []
        if not pending:
            return
        self._walks.new_round()  # a backward ended: values="all" walks its modules anew
        flags: dict = {}  # device -> [(keys, a 1-d bool tensor: one flag a key)]
        printed: dict = {}  # device -> (a check per row, forward's rows, recompute's rows)
        small: dict = {}  # device -> (check, bytes its recompute left, before) of each state
        suspects: set[int] = set()
        for i, check in enumerate(pending):
            if check.host_changed():
                suspects.add(i)
            for device, forward, recompute in check.print_columns():
                owners, fs, rs = printed.setdefault(device, ([], [], []))
                owners += [i] * forward.numel()
                fs.append(forward)
                rs.append(recompute)
            if check.state is not None:
                for device, pair in check.state.pairs().items():
                    if pair is None:  # a small tensor changed shape or can no longer be read
                        suspects.add(i)
                    else:
                        small.setdefault(device, []).append((i, *pair))
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            for device, (owners, fs, rs) in printed.items():  # every check's prints at once
                flags.setdefault(device, []).append((owners, torch.cat(fs) != torch.cat(rs)))
            for device, items in small.items():  # every region's small state in one pass
                flags.setdefault(device, []).append(([items], any_changed(items).reshape(1)))
        again: dict = {}  # where some region's small state changed: each region's flag
        for device, group in flags.items():  # the one synchronisation per device
            for key in _flagged(group):
                if isinstance(key, list):  # the device's small state: which regions
                    again[device] = changed_flags(key)
                else:
                    suspects.add(key)
        for group in again.values():  # a second one, only there
            suspects.update(_flagged([([i], f.reshape(1)) for i, f in group]))
        # The suspects judged in full (they synchronise again), in the order they were
        # recomputed: a tensor two of them wrote gets the first one's contents from before.
        given_back: set[int] = set()
        for i in sorted(suspects):
            pending[i].finish(given_back)

    def raise_pending(self) -> None:
        """Judge what is queued, and raise a detection whose region never ran again (done on
        exit; the pytest plugin calls it at the end of each test's call)."""
        self._flush()
        armed, self._armed = self._armed, {}
        for found in armed.values():
            if found.within_tolerance:
                self.lowerings_accepted += 1
            elif found.declared:
                self.declared_writes += 1
            else:
                raise unlocated_error(found, "the program ran no further region at its call "
                                      "site (values='all' locates a divergence on the call "
                                      "site's next recompute, in the next step)")

    def recomputed(self, site) -> None:
        count = self._sites.get(site[:1])
        if count is not None:
            count[1] = True

    def _printed(self, position: int, rounds: int) -> bool:
        """``all``: every region; ``sampled``: every ``sample_every``-th region of a call site's
        round, the first one moving by one each round (a loop over a multiple of
        ``sample_every`` layers has each layer printed within ``sample_every`` steps);
        ``none``: none."""
        if self.values == "all":
            return True
        if self.values == "none":
            return False
        return (position + rounds) % self.sample_every == 0

    def _found(self, watch: Watch, found: Detection) -> None:
        """A recompute the detect tier found different: ``all`` locates it on its call site's
        next round; the other modes raise now, unlocated."""
        key = (watch.site[:1], watch.position)
        if found.within_tolerance and (self.values != "all" or key in self._tolerated):
            # sampled / none: accepted unlocated; all: once the locator found it a lowering
            self.lowerings_accepted += 1
            return
        if found.declared and (self.values != "all" or key in self._tolerated):
            self.declared_writes += 1  # left to values="all"'s locator (see _detect)
            return
        if not (found.within_tolerance or found.declared):  # else provisional
            self.detections += 1
        if found.fatal:
            error = unlocated_error(found, "torch's checkpoint (or autograd) fails on such a "
                                    "recompute before a next one could locate it")
            if watch in self._for_torch:  # torch's own check comes next: it speaks first
                self._for_torch[watch] = error
                return
            raise error
        if self.values == "all":
            self._armed[key] = found
            return
        raise unlocated_error(found, f"values={self.values!r} keeps no op stream; "
                              "values='all' locates the first op that differs on the region's "
                              "next recompute")

    # -- the wrappers ---------------------------------------------------------------------------

    def wrap_generator(self, original):
        # functools.wraps: the original's attributes come along (a wrapper that marks itself
        # installed, as fixes.torchtitan's nested-checkpoint one does, is then not stacked
        # again on top of this one for every sanitizer entered after it).
        @functools.wraps(original)
        def _checkpoint_without_reentrant_generator(fn, *rest, **kwargs):
            if not self._on() or not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return (yield from original(fn, *rest, **kwargs))
            caller = sys._getframe(1).f_globals.get("__name__", "")
            roots = roots_of(fn, rest, kwargs)
            if caller.startswith("torch_remat"):
                region = self.region("torch_remat", fn, opaque=True, reentrant=False,
                                     roots=roots, args=rest, kwargs=kwargs)
            else:
                region = self.region("torch.utils.checkpoint, non-reentrant", fn,
                                     reentrant=False, roots=roots, args=rest, kwargs=kwargs)
            entry = entry_frame(sys._getframe(1))
            inner = original(region.replaying(fn), *rest, **kwargs)
            next(inner)  # the checkpoint's hooks and the caller's forward context are entered
            frame = _checkpoint_frame(inner)
            if frame is not None:  # judge each recompute outside its contexts
                frame.recompute_fn = region.judging(frame.recompute_fn)
                if isinstance(region, Watch):
                    frame.check_recomputed_tensors_match = self._torch_check_first(region,
                                                                                   frame)
            try:
                with region.recording(entry):  # innermost: inside the caller's forward context
                    yield
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as exc:
                inner.throw(exc)
                raise
            try:
                next(inner)
            except StopIteration:
                return
            raise AssertionError("torch.utils.checkpoint's generator yielded more than twice")

        return _checkpoint_without_reentrant_generator

    def _torch_check_first(self, watch: Watch, frame):
        """The checkpoint frame's ``check_recomputed_tensors_match``, which runs right after
        each recompute: where it raises torch's own ``CheckpointError`` (another count or
        metadata of saved tensors: what the detect tier's fatal detections are) the user gets
        torch's error, in its words, with the sanitizer's finding (region, call site) as a
        note; where torch does not check (``determinism_check="none"``), the sanitizer's."""
        self._for_torch[watch] = None
        # the frame through a weak reference: frame -> this wrapper -> frame would be a cycle
        # that holds the region's inputs and graph until the cycle collector runs
        check, frame = type(frame).check_recomputed_tensors_match, weakref.ref(frame)

        def checked(gid):
            ours = self._for_torch.get(watch)
            self._for_torch[watch] = None
            try:
                check(frame(), gid)
            except torch_checkpoint.CheckpointError as exc:
                if ours is not None:
                    exc.add_note(f"stackfix recompute_sanitizer: {ours}")
                raise
            if ours is not None:
                try:  # no local left holding the error whose traceback holds this frame
                    raise ours
                finally:
                    ours = None

        return checked

    def wrap_function_forward(self, original, kind: str):
        def forward(ctx, run_function, *args):
            outer_grad, _apply.grad = getattr(_apply, "grad", False), False
            if not self._on() or torch.compiler.is_compiling():
                return original(ctx, run_function, *args)
            roots = roots_of(run_function, args)
            unreached = outer_grad and not any(isinstance(a, torch.Tensor) and a.requires_grad
                                               for a in args)
            # the never-recomputed check reads what this forward runs: recorded, not lent
            region = self.region(kind, run_function, roots=roots,
                                 args=None if unreached else args)
            if isinstance(region, Watch):  # its forward records the modules it runs
                out = original(ctx, region.function(run_function), *args)
                if not unreached:
                    return out
                ran = region.ran()
            elif unreached:  # the locator's region records none: recorded here for the check
                with self._modules_run.recording() as ran:
                    out = original(ctx, region.function(run_function), *args)
            else:
                return original(ctx, region.function(run_function), *args)
            error = never_recomputed_error(region.name(), roots, ran)  # unreached, here
            if error is not None:
                raise error
            return out

        return staticmethod(forward)

    def wrap_checkpoint_method(self, original, kind: str):
        def checkpoint(obj, run_function, *args):
            if self._on() and not torch.compiler.is_compiling():
                run_function = self.region(kind, run_function, roots=roots_of(
                    run_function, args), args=args).function(run_function)
            return original(obj, run_function, *args)

        return checkpoint


def _flagged(group: list[tuple[list, torch.Tensor]]) -> list:
    """The keys of ``group`` (one device's ``(keys, 1-d bool flags, one a key)``) whose flag
    is set (a key once per set flag): one synchronisation."""
    bad = torch.cat([f for _, f in group]).tolist()
    keys = itertools.chain.from_iterable(k for k, _ in group)
    return [key for key, b in zip(keys, bad, strict=True) if b]


_slot = ActiveSlot("recompute_sanitizer()")


@contextlib.contextmanager
def recompute_sanitizer(values: Values | Literal["all", "sampled", "none"] = Values.ALL,
                        sample_every: int = 8) -> Iterator[RecomputeSanitizer]:
    """While active, every checkpointed region records its forward and judges each recompute
    against it by what backward uses (the saved tensors of a non-reentrant region, the outputs
    of a reentrant one, and the tensors outside the region it leaves changed); a difference
    raises ``RecomputeMismatchError`` when the recompute ends, naming what differs and where
    the recompute first departs from its forward (op, position, both call sites). Not
    reentrant: RuntimeError if active (a test's own entry with the pytest plugin's arguments
    joins the plugin's, as ``storage_sanitizer()``'s does).

    ``values`` (a ``Values`` or its name): which regions are fingerprinted, besides the count
    and metadata of what backward uses and the state the regions reach, checked in every
    region. ``"all"``: every region; a difference arms the locator for the region's next
    round (the next step), whose error names the first op that differs and both call sites;
    one that does not recur there, or a region not run again before exit, is raised
    unlocated. ``"sampled"``: every ``sample_every``-th region of a call site, rotating each
    round; ``"none"``: none. Both raise unlocated at the end of the backward that found it.
    A count or metadata difference (torch itself fails on it) is raised at once, unlocated
    (an unlocated error's ``what`` is ``Divergence.UNLOCATED``, ``"not located"``).
    A reentrant region entered with grad whose inputs none require grad, reaching trainable
    parameters, raises when its forward ends (never recomputed). ValueError for anything
    else."""
    if isinstance(values, Values):
        values = values.value
    if not isinstance(values, str) or values not in VALUES:
        raise ValueError(f"recompute_sanitizer: values must be one of "
                         f"{', '.join(map(repr, VALUES))} (or a Values), got {values!r}")
    if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1:
        raise ValueError(f"recompute_sanitizer: sample_every must be an int >= 1, got "
                         f"{sample_every!r}")
    arguments = f"values={values!r}, sample_every={sample_every}"
    joined = _slot.joinable(arguments)
    if joined is not None:  # the pytest plugin's, entered by this thread: this entry joins it
        yield joined
        return
    here = call_site()
    sanitizer = RecomputeSanitizer(values=values, sample_every=sample_every)
    _slot.claim(sanitizer, here, arguments)
    patches: list[_Patch] = []
    hook = None

    def patch_megatron(module) -> None:
        cls = module.CheckpointFunction
        patches.append(_Patch(cls, "forward", lambda f: sanitizer.wrap_function_forward(
            f, "megatron-core tensor_parallel CheckpointFunction")))
        patches.append(_ApplyPatch(cls))
        sanitizer.wrapped.append(f"{_MEGATRON}.CheckpointFunction.forward")
        if hasattr(module, "CheckpointWithoutOutput"):  # selective recompute (recompute_modules)
            patches.append(_Patch(module.CheckpointWithoutOutput, "checkpoint",
                                  lambda f: sanitizer.wrap_checkpoint_method(
                                      f, "megatron-core CheckpointWithoutOutput")))
            sanitizer.wrapped.append(f"{_MEGATRON}.CheckpointWithoutOutput.checkpoint")

    def patch_composable(module) -> None:
        # torch.distributed._composable.checkpoint binds the generator at its import.
        patches.append(_Patch(module, "_checkpoint_without_reentrant_generator",
                              sanitizer.wrap_generator))
        sanitizer.wrapped.append(f"{_COMPOSABLE}._checkpoint_without_reentrant_generator")

    try:
        patches.append(_Patch(torch_checkpoint, "_checkpoint_without_reentrant_generator",
                              sanitizer.wrap_generator))
        patches.append(_Patch(torch_checkpoint.CheckpointFunction, "forward",
                              lambda f: sanitizer.wrap_function_forward(
                                  f, "torch.utils.checkpoint, reentrant")))
        patches.append(_ApplyPatch(torch_checkpoint.CheckpointFunction))
        sanitizer.wrapped += ["torch.utils.checkpoint._checkpoint_without_reentrant_generator",
                              "torch.utils.checkpoint.CheckpointFunction.forward"]
        later = {}
        for name, patch, installed in ((_MEGATRON, patch_megatron, _has_megatron),
                                       (_COMPOSABLE, patch_composable, lambda: True)):
            if name in sys.modules:
                patch(sys.modules[name])
            elif installed():
                later[name] = patch
        if later:  # patched when imported while the sanitizer is active
            hook = OnImport(later)
            sys.meta_path.insert(0, hook)
        try:
            with sanitizer._walks.watching():
                yield sanitizer
        except Exception:
            # A detection made during a backward comes before the program's own later failure
            # (a wrong result it checks, say): it names the cause, with that failure as context.
            sanitizer.raise_pending()
            raise
        sanitizer.raise_pending()
    finally:
        try:
            sanitizer._modules_run.close()  # a region's forward left suspended keeps no hook
            if hook is not None:
                sys.meta_path.remove(hook)
            for patch in reversed(patches):
                patch.undo()
        finally:
            _slot.release()
