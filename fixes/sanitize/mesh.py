"""``mesh_sanitizer()``: code that needs the spmd mesh and finds none during backward raises
``MeshLostError`` instead of silently computing something other than its forward did.

Why: torchtitan 0.3.0's tensor-parallel layers redistribute through
``spmd_redistribute_per_axis(x, current_spmd_mesh(), ...)``, which returns ``x`` unchanged when no
mesh is current. spmd_types keeps the mesh in a thread-local stack, so an activation-checkpoint
recompute outside the mesh context (verl before #6950) or on an autograd device thread
(torchtitan #3565) skips every collective and gives wrong gradients at TP > 1, without an error.

What is wrapped while active (every module namespace that holds the function by name, also
modules imported meanwhile; all put back on exit):

* ``torchtitan.distributed.spmd_types.spmd_redistribute_per_axis`` where torchtitan is
  installed: called with no mesh inside any backward, for a type change it would have made,
  it raises naming the axes and types.
* ``spmd_types.current_mesh`` / ``current_mesh_names`` / ``current_mesh_all_names`` (outside
  spmd_types' own modules): no mesh inside checkpoint recompute raises naming the caller, the
  forward code that is about to branch on the missing mesh. Lookups from backward hooks, and
  from a context entered or left around the replay (state saved and restored, e.g. torch_remat's
  recompute state hooks), are left alone: only the replayed forward is forward code.

Both raise only once a mesh has been seen while the sanitizer is active: a program that never
had one cannot have lost it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from fixes.sanitize._callsite import ActiveSlot, call_site, describe_site
from fixes.sanitize._on_import import OnImport

__all__ = ["MeshLostError", "MeshSanitizer", "mesh_sanitizer"]

_TITAN_MODULE = "torchtitan.distributed.spmd_types"
_TITAN_REDISTRIBUTE = "spmd_redistribute_per_axis"
_LOOKUPS = ("current_mesh", "current_mesh_names", "current_mesh_all_names")
_MARK = "__stackfix_mesh_sanitizer_wraps__"
_FIX_HINT = ("keep the recompute inside the forward's mesh: checkpoint with "
             "context_fn=fixes.torchtitan.mesh_preserving_context_fn, or run backward inside "
             "the mesh context with single_threaded_backward()")


class MeshLostError(RuntimeError):
    """Code that depends on the current spmd mesh ran during backward with none set."""

    def __init__(self, message: str, *, op: str, site: tuple[str, ...]):
        self.op, self.site = op, site
        super().__init__(message)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# Where the Python stack enters the autograd engine: frames further out called backward().
_ENGINE_ENTRY = {("torch.autograd.graph", "_engine_run_backward"),
                 ("torch.autograd", "backward"), ("torch.autograd", "grad")}
# A context entered or left around the replay (a recompute context, torch_remat's recompute
# state hooks) saves and restores the replaying thread's state: its lookups are not forward code.
_CONTEXT_EDGES = ("__enter__", "__exit__")


def _is_recompute_machinery(module: str | None, code) -> bool:
    """Frames that replay a checkpointed forward: torch.utils.checkpoint (non-reentrant
    recompute_fn, reentrant CheckpointFunction.backward), torch_remat, and any reentrant
    checkpoint Function's backward (megatron's CheckpointFunction)."""
    if module == "torch.utils.checkpoint" or (module or "").startswith("torch_remat"):
        return True
    qualname = getattr(code, "co_qualname", code.co_name)
    return code.co_name == "backward" and "checkpoint" in qualname.lower()


def _in_recompute() -> bool:
    """The caller is forward code that a checkpoint's recompute replays: recompute machinery
    called it (not from a context's ``__enter__`` / ``__exit__``), with no autograd engine entry
    in between (a backward hook's stack has none; on a device thread the stack starts there)."""
    frame, in_machinery = sys._getframe(2), False
    while frame is not None:
        code, module = frame.f_code, frame.f_globals.get("__name__")
        if (module, code.co_name) in _ENGINE_ENTRY or code.co_name in _CONTEXT_EDGES:
            return False
        machinery = _is_recompute_machinery(module, code)
        if in_machinery and not machinery:
            return True  # past the machinery that called the replayed forward
        in_machinery = machinery
        frame = frame.f_back
    return in_machinery


def _axis(name) -> str:
    return str(getattr(name, "value", name))


@dataclass
class MeshSanitizer:
    """What ``mesh_sanitizer()`` yields: which functions it wraps, and what it saw."""

    wrapped: list[str] = field(default_factory=list)  # "module.function" of every seam
    not_wrapped: dict[str, str] = field(default_factory=dict)  # seam -> why not (import error)
    mesh_seen: bool = False

    def _on(self) -> bool:
        """Wrappers left behind (e.g. restored by a test's monkeypatch) pass calls through."""
        return _slot.holds(self)

    # -- the wrappers ---------------------------------------------------------------------------

    def wrap_redistribute(self, original: Callable) -> Callable:
        def spmd_redistribute_per_axis(x, mesh, src_types, dst_types, *args, **kwargs):
            if not self._on():
                return original(x, mesh, src_types, dst_types, *args, **kwargs)
            if mesh is not None:
                self.mesh_seen = True
            elif self.mesh_seen and _in_backward():
                changes = [f"{_axis(a)}: {src_types.get(a)!r} -> {dst!r}"
                           for a, dst in dst_types.items() if src_types.get(a) != dst]
                if changes:
                    site = call_site()
                    raise MeshLostError(
                        f"{_TITAN_REDISTRIBUTE} ran during backward with no current spmd mesh "
                        f"[thread {threading.current_thread().name}], so it returns its input "
                        f"(shape {list(getattr(x, 'shape', ()))}) unchanged instead of "
                        f"redistributing {{{', '.join(changes)}}}: the collective is skipped and "
                        f"the result silently differs from the forward's. Called from "
                        f"{describe_site(site)}. The forward ran with a mesh; {_FIX_HINT}.",
                        op=_TITAN_REDISTRIBUTE, site=site,
                    )
            return original(x, mesh, src_types, dst_types, *args, **kwargs)

        return spmd_redistribute_per_axis

    def wrap_lookup(self, original: Callable) -> Callable:
        name = f"spmd_types.{original.__name__}"

        def lookup(*args, **kwargs):
            result = original(*args, **kwargs)
            if not self._on():
                return result
            if result is not None:
                self.mesh_seen = True
            elif self.mesh_seen and _in_backward() and _in_recompute():
                site = call_site()
                raise MeshLostError(
                    f"{name}() found no current spmd mesh during activation-checkpoint "
                    f"recompute [thread {threading.current_thread().name}], called from "
                    f"{describe_site(site)}. The forward saw a mesh, so forward code that "
                    "branches on it now computes something else (e.g. skips a collective, as "
                    f"torchtitan's {_TITAN_REDISTRIBUTE} does with no mesh); {_FIX_HINT}.",
                    op=name, site=site,
                )
            return result

        lookup.__name__ = lookup.__qualname__ = original.__name__
        lookup.__doc__ = original.__doc__
        return lookup


# -- wrapping a function in every namespace that holds it ---------------------------------------


@dataclass
class _Seam:
    module: str  # where the function is defined
    name: str
    make_wrapper: Callable[[Callable], Callable]
    skip_prefix: str | None = None  # namespaces left alone (the package's own internals)
    wrapper: Callable | None = None
    original: Callable | None = None

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"

    def _namespaces(self) -> Iterator[types.ModuleType]:
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            if self.skip_prefix and module.__name__.startswith(self.skip_prefix):
                continue
            yield module

    def install(self, defining: types.ModuleType) -> None:
        current = getattr(defining, self.name)
        self.original = getattr(current, _MARK, current)  # a wrapper left behind by a monkeypatch
        self.wrapper = self.make_wrapper(self.original)
        setattr(self.wrapper, _MARK, self.original)
        for module in self._namespaces():
            value = module.__dict__.get(self.name)
            if value is self.original or (value is not None and getattr(value, _MARK, None)
                                           is self.original):
                setattr(module, self.name, self.wrapper)

    def uninstall(self) -> None:
        if self.wrapper is None:
            return
        for module in self._namespaces():
            if module.__dict__.get(self.name) is self.wrapper:
                setattr(module, self.name, self.original)


_slot = ActiveSlot("mesh_sanitizer()")


def _require_spmd_types():
    try:
        return importlib.import_module("spmd_types")
    except ImportError as exc:
        raise ModuleNotFoundError(
            "mesh_sanitizer() needs spmd_types (pip install spmd-types; torchtitan 0.3.0 pins "
            f"0.2.3), which does not import here: {exc}", name="spmd_types",
        ) from exc


@contextlib.contextmanager
def mesh_sanitizer() -> Iterator[MeshSanitizer]:
    """While active, a torchtitan spmd redistribution or an spmd_types mesh lookup that finds no
    mesh during backward / checkpoint recompute raises ``MeshLostError`` (see the module
    docstring). Needs spmd_types (ModuleNotFoundError naming it otherwise); torchtitan's seam
    is wrapped where torchtitan is installed. Not reentrant: RuntimeError if already active
    (a test's own entry joins the pytest plugin's, as ``storage_sanitizer()``'s does)."""
    spmd_types = _require_spmd_types()
    if not hasattr(torch._C, "_current_graph_task_id"):
        raise RuntimeError(f"mesh_sanitizer() needs torch._C._current_graph_task_id "
                           f"(torch {torch.__version__} lacks it)")
    joined = _slot.joinable()
    if joined is not None:  # the pytest plugin's, entered by this thread: this entry joins it
        yield joined
        return
    here = call_site()
    sanitizer = MeshSanitizer()
    _slot.claim(sanitizer, here)
    lookups = [_Seam(spmd_types.__name__, name, sanitizer.wrap_lookup, skip_prefix="spmd_types.")
               for name in _LOOKUPS]
    titan = _Seam(_TITAN_MODULE, _TITAN_REDISTRIBUTE, sanitizer.wrap_redistribute)
    seams = [*lookups, titan]  # each undone on exit if it was installed
    hook = None
    try:
        for seam in lookups:
            seam.install(spmd_types)
            sanitizer.wrapped.append(seam.label)
        if _TITAN_MODULE in sys.modules:
            titan.install(sys.modules[_TITAN_MODULE])
            sanitizer.wrapped.append(titan.label)
        elif importlib.util.find_spec("torchtitan") is not None:
            hook = OnImport({_TITAN_MODULE: titan.install})
            sys.meta_path.insert(0, hook)
            sanitizer.wrapped.append(titan.label + " (on import)")
        else:
            sanitizer.not_wrapped[titan.label] = "torchtitan is not installed"
        yield sanitizer
    finally:
        try:
            if hook is not None:
                sys.meta_path.remove(hook)
            for seam in seams:
                seam.uninstall()
        finally:
            _slot.release()
