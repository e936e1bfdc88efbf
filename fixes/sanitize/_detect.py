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
  (``_fingerprint``: position-weighted integer sums, one host synchronisation per device);
* writes outside the region by the recompute: the tensors the region reaches (its inputs, and
  the parameters, buffers and tensor attributes of the modules its function and arguments
  hold) -- small non-parameter ones by their contents before and after (batch norm updates its
  running statistics without bumping their version counter), the others by version counter.

Not seen: state the region does not reach that way (a global tracker, a tensor behind an
object that is no module), a rebound Python attribute, state outside tensors (a communicator
handle, a Python counter) -- unless its effect reaches the saved tensors or outputs, where it
is caught. Writes inside ``recompute_may_differ`` blocks are not told apart from the region's
own (the locator, ``_region``, tells them apart).

When a recompute differs, ``values="all"`` locates it on the call site's next recompute: the
region at the same position among that call site's regions in the next round (forwards after
a backward) records its op stream (``_region``) and its error names the first diverging op
and both call sites; a divergence that does not recur there (or a program that never runs the
region again) raises the detection's own error, unlocated. ``sampled`` and ``none`` raise the
unlocated error at once.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from fixes.recompute import state as recompute_state
from fixes.sanitize import _fingerprint as fp
from fixes.sanitize import _intended
from fixes.sanitize._callsite import describe_site
from fixes.sanitize._errors import Divergence, RecomputeMismatchError, Verdict

__all__ = ["Detection", "Watch", "never_recomputed_error", "unlocated_error"]

SMALL_STATE_BYTES = 1 << 16  # reached non-parameter tensors up to this size: compared by value
_PLAIN = (torch.Tensor, torch.nn.Parameter)


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


def unlocated_error(found: Detection, why: str) -> RecomputeMismatchError:
    message = (f"recompute of checkpointed region {found.region} differs from its forward "
               f"({found.verdict}): {found.item}: {found.detail}. Not located: {why}.")
    return RecomputeMismatchError(
        message, region=found.region, verdict=found.verdict, item=found.item,
        what=Divergence.UNLOCATED, position=None, op=None, forward_site=(), recompute_site=())


def never_recomputed_error(region: str, roots) -> RecomputeMismatchError | None:
    """A reentrant region entered with grad enabled whose inputs none require grad is never
    recomputed (its output has no grad_fn): the trainable parameters its function uses get no
    gradient, silently (a frozen base model under PEFT, detached MTP inputs; torch's reentrant
    checkpoint only warns, megatron's says nothing). The error naming them, or None if every
    parameter it reaches is frozen."""
    names: dict[int, str] = {}
    for root in roots:
        if isinstance(root, torch.nn.Module):
            for name, p in root.named_parameters():
                if p.requires_grad:
                    names.setdefault(id(p), f"{type(root).__name__}.{name}")
    for t in _reached(roots):
        if isinstance(t, torch.nn.Parameter) and t.requires_grad:
            names.setdefault(id(t), f"a parameter of shape {list(t.shape)}")
    if not names:
        return None
    listed = ", ".join(list(names.values())[:8]) + (
        f" and {len(names) - 8} more" if len(names) > 8 else "")
    message = (f"checkpointed region {region} is never recomputed: it was entered with grad "
               "enabled, but none of its inputs requires grad, so the reentrant checkpoint's "
               "output has no grad_fn and backward never reaches it; its trainable parameters "
               f"get no gradient: {listed}. Make an input require grad (e.g. "
               "hidden_states.requires_grad_() on a frozen embedding's output) or use the "
               "non-reentrant checkpoint (use_reentrant=False).")
    return RecomputeMismatchError(
        message, region=region, verdict=Verdict.NEVER_RECOMPUTED, item=listed,
        what=Divergence.UNLOCATED, position=None, op=None, forward_site=(), recompute_site=())


# -- what a region reaches ---------------------------------------------------------------------


def _reached(roots) -> list[torch.Tensor]:
    """The plain tensors reachable from ``roots`` (the region's function and arguments): the
    tensors among them (and in their closures, partials, lists, dicts, one level deep), and
    every parameter, buffer and tensor attribute of the modules among them."""
    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, torch.nn.Module] = {}

    def visit(obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if type(obj) in _PLAIN:
                tensors.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            modules.setdefault(id(obj), obj)
        elif depth > 2:
            return
        elif isinstance(obj, (list, tuple)):
            for x in obj[:64]:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in list(obj.values())[:64]:
                visit(x, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif callable(obj):
            visit(getattr(obj, "__self__", None), depth + 1)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            code, names = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
            if code is not None and isinstance(names, dict):  # the globals it names
                for name in code.co_names:
                    value = names.get(name)
                    if isinstance(value, (torch.Tensor, torch.nn.Module, dict, list)):
                        visit(value, depth + 1)

    def attribute(value, depth: int) -> None:
        """Tensors held in a module's attributes: directly, or in a dict, list or plain
        object they hold (TransformerEngine's ``fp8_meta``), two levels deep."""
        if isinstance(value, torch.Tensor):
            if type(value) in _PLAIN:
                tensors.setdefault(id(value), value)
        elif depth >= 2 or isinstance(value, (torch.nn.Module, type, str, bytes, int, float)):
            return
        elif isinstance(value, dict):
            for x in list(value.values())[:64]:
                attribute(x, depth + 1)
        elif isinstance(value, (list, tuple)):
            for x in value[:64]:
                attribute(x, depth + 1)
        elif not callable(value) and isinstance(getattr(value, "__dict__", None), dict):
            for x in list(vars(value).values())[:64]:
                attribute(x, depth + 1)

    for root in roots:
        visit(root, 0)
    for module in list(modules.values()):
        for sub in module.modules():
            for name, value in sub.__dict__.items():  # attributes that are no parameter/buffer
                if not name.startswith("_"):
                    attribute(value, 0)
            for t in (*sub._parameters.values(), *sub._buffers.values()):
                if t is not None and type(t) in _PLAIN:
                    tensors.setdefault(id(t), t)
    # visit and attribute each name itself: a cycle through their cells that would keep the
    # reached tensors (the region's inputs, their graph) until the cycle collector runs
    visit = attribute = None  # noqa: F841
    return list(tensors.values())


def _small(t: torch.Tensor) -> bool:
    return (not isinstance(t, torch.nn.Parameter) and t.numel() * t.element_size()
            <= SMALL_STATE_BYTES and fp.readable(t))


class _State:
    """The reached tensors as a recompute found them: small non-parameter ones by a copy,
    the others by version counter; ``changed()`` after the recompute: those it left changed."""

    def __init__(self, reached: list[torch.Tensor]):
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.versions: list[tuple[torch.Tensor, int]] = []
        self.declarations = _intended.entered()
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            for t in reached:
                if _small(t):
                    self.copies.append((t, t.detach().clone()))
                elif t.layout is torch.strided and not t.is_meta:
                    self.versions.append((t, t._version))

    def changed(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(tensor, its copy from before or None) for each tensor left changed, less scratch and
        the storages ``fixes.recompute`` replays."""
        found: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if self.copies:
            with torch.no_grad(), torch._C._DisableTorchDispatch():
                flags: dict = {}
                for i, (t, c) in enumerate(self.copies):
                    same = t.shape == c.shape and t.dtype == c.dtype
                    flag = (fp.bits(t) != fp.bits(c)).any() if same else torch.tensor(True)
                    flags.setdefault(flag.device, []).append((i, flag))
                bad = [i for group in flags.values()  # one host synchronisation per device
                       for (i, _), f in zip(group, torch.stack([f for _, f in group]).tolist(),
                                            strict=True) if f]
            found += [self.copies[i] for i in sorted(bad)]
        found += [(t, None) for t, v in self.versions if t._version != v]
        if not found:
            return found
        managed = recompute_state.managed_storages()
        return [(t, c) for t, c in found
                if (key := t.untyped_storage()._cdata) not in managed
                and _intended.scratch_reason(key) is None]


# -- one side ----------------------------------------------------------------------------------


def _valued(t: torch.Tensor) -> bool:
    """Values compared: not a 0-d integer tensor on CUDA (fused attention's philox seed and
    offset, drawn anew by a recompute with no effect when dropout is off)."""
    return not (t.dim() == 0 and not t.is_floating_point() and t.device.type == "cuda")


@dataclass(slots=True)
class _Side:
    metas: list = field(default_factory=list)
    prints: list | None = None
    loose: list | None = None  # tolerant prints (reentrant outputs, CUDA without determinism)


def _side(tensors: list[torch.Tensor], printed: bool, tolerant: bool) -> _Side:
    side = _Side([(tuple(t.shape), t.dtype, t.device.type) for t in tensors])
    if printed:
        side.prints = [fp.fingerprint([t]) if _valued(t) else None for t in tensors]
        if tolerant:
            side.loose = [fp.fingerprint([t], tolerant=True) if _valued(t) else None
                          for t in tensors]
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
                 reentrant: bool, printed: bool, found):
        self.kind, self.label, self.site, self.stats = kind, label, site, stats
        self.reentrant, self.printed, self.found = reentrant, printed, found
        self._roots = [weakref.ref(r) if _weakable(r) else r for r in roots]
        self.forward: _Side | None = None
        self.broken: str | None = None
        self.judged_outside = False
        self._state: _State | None = None
        self._recompute: tuple | None = None  # (tensors, stopped early) awaiting the verdict
        self.position = 0  # among its call site's regions in this round (the sanitizer's)

    def name(self) -> str:
        return f"{self.label} ({self.kind}, checkpointed at {describe_site(self.site)})"

    def reached(self) -> list[torch.Tensor]:
        roots = [r() if isinstance(r, weakref.ref) else r for r in self._roots]
        return _reached([r for r in roots if r is not None])

    # -- non-reentrant -------------------------------------------------------------------------

    def recording(self, entry=None):
        self.stats.regions += 1
        return _Recording(self)

    def replaying(self, fn):
        def recompute_function(*args, **kwargs):
            if not self.judged_outside:
                self._state = _State(self.reached())
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
            self._state = _State(self.reached())
            stop = None
            try:
                recompute_fn(*args)
            except BaseException as exc:
                if type(exc).__name__ != "_StopRecomputationError":
                    self._recompute = self._state = None
                    raise
                stop = exc
            self._judge_saved()
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
                out = fn(*args, **kwargs)
                self._finish_forward(fp.tensors(out))
                return out
            self.stats.recomputes += 1
            self.stats.recomputed(self.site)
            state = _State(self.reached())
            out = fn(*args, **kwargs)
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

    def _judge(self, tensors: list[torch.Tensor], state: _State | None, stopped: bool) -> None:
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
        self.stats.defer(_Check(self, recompute, state))

    def _shape_difference(self, tensors, stopped) -> tuple[Detection | None, _Side | None]:
        forward = self.forward
        what = Verdict.OUTPUT if self.reentrant else Verdict.SAVED_TENSOR
        noun = "output" if self.reentrant else "saved tensor"
        if self.reentrant:
            self.stats.outputs_compared += len(tensors)
        else:
            self.stats.saved_compared += len(tensors)
        n_f, n_r = len(forward.metas), len(tensors)
        if n_r != n_f and (self.reentrant or (n_r < n_f and not stopped)):
            verdict = Verdict.OUTPUT if self.reentrant else Verdict.SAVED_COUNT
            return Detection(self.name(), self.site, verdict, f"the {noun}s",
                             f"the forward made {n_f} {noun}s, the recompute {n_r}",
                             fatal=True), None
        tensors = tensors[:n_f]
        recompute = _side(tensors, self.printed, forward.loose is not None)
        self.stats.fingerprints += len(tensors) if self.printed else 0
        for i, (a, b) in enumerate(zip(forward.metas, recompute.metas, strict=False)):
            if a != b:
                return Detection(self.name(), self.site, what, f"{noun} #{i} of {n_f}",
                                 f"forward {_meta(a)}, recompute {_meta(b)}", fatal=True), None
        return None, recompute

    def _value_difference(self, recompute: _Side, state: _State | None) -> Detection | None:
        forward = self.forward
        what = Verdict.OUTPUT if self.reentrant else Verdict.SAVED_TENSOR
        noun = "output" if self.reentrant else "saved tensor"
        changed = state.changed() if state is not None else []
        if changed:
            self.stats.outside_writes += len(changed)
            t, before = changed[0]
            declared = _intended.entered() != state.declarations
            if before is not None and not declared:  # its contents from before, back
                with torch.no_grad(), torch._C._DisableTorchDispatch():
                    for u, c in changed:
                        if c is not None:
                            u.copy_(c)
            shape = f"shape {list(t.shape)}, {str(t.dtype).removeprefix('torch.')}"
            more = f"; {len(changed) - 1} more such tensors" if len(changed) > 1 else ""
            return Detection(self.name(), self.site, Verdict.SIDE_EFFECT,
                             f"a tensor outside the region ({shape})",
                             "the recompute leaves a tensor the region reaches (a module "
                             "buffer, parameter, attribute or the region's input) changed, so "
                             "the forward's update would be applied a second time" +
                             (" (the sanitizer gave it its contents back)"
                              if before is not None and not declared else "") + more,
                             declared=declared)
        if not self.printed:
            return None
        pairs = _pairs(forward.prints, recompute.prints)
        index = fp.first_different(pairs)
        within = False
        if index is not None and forward.loose is not None:
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
    synchronisation: ``flags()`` are 0-d device tensors, true where something may differ
    (exact prints, small state); ``host_changed`` is known without a synchronisation (version
    counters)."""

    def __init__(self, watch: Watch, recompute: _Side, state: _State | None):
        self.watch, self.recompute, self.state = watch, recompute, state

    def host_changed(self) -> bool:
        return self.state is not None and any(t._version != v for t, v in self.state.versions)

    def flags(self) -> list[torch.Tensor]:
        out = []
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            if self.state is not None:
                for t, c in self.state.copies:
                    if t.shape != c.shape or t.dtype != c.dtype:
                        out.append(torch.tensor(True))
                    else:
                        out.append((fp.bits(t) != fp.bits(c)).any())
            if self.watch.printed and self.watch.forward is not None:
                a_all, b_all = [], []
                for a, b in _pairs(self.watch.forward.prints, self.recompute.prints):
                    if a is None:
                        continue
                    if a.shape() != b.shape() or a.device != b.device:
                        out.append(torch.tensor(True))
                        continue
                    a_all += a.exact
                    b_all += b.exact
                    a_all += a.approx
                    b_all += b.approx
                by_device: dict = {}
                for x, y in zip(a_all, b_all, strict=True):
                    by_device.setdefault(x.device, ([], []))
                    by_device[x.device][0].append(x)
                    by_device[x.device][1].append(y)
                for xs, ys in by_device.values():
                    out.append((torch.stack(xs) != torch.stack(ys)).any())
        return out

    def finish(self) -> None:
        watch = self.watch
        try:
            found = watch._value_difference(self.recompute, self.state)
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

    def __enter__(self):
        self.packs.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.packs.__exit__()
        tensors, self.packs = self.packs.tensors, None
        if exc_type is None:
            self.watch._finish_forward(tensors)
        return False


def _meta(m) -> str:
    shape, dtype, device = m
    return f"({list(shape)}, {str(dtype).removeprefix('torch.')}, {device})"


def _weakable(obj) -> bool:
    return isinstance(obj, (torch.Tensor, torch.nn.Module))


def roots_of(fn, args, kwargs=None) -> list:
    """The objects a region's state is reached from: its function and its tensor arguments."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs or {}))
              if isinstance(x, (torch.Tensor, torch.nn.Module))]
    return [fn, *leaves]
