"""Mesh-safe activation checkpointing: recompute sees the spmd mesh its forward saw.

Why: spmd_types keeps the current mesh in a ``threading.local`` stack
(``spmd_types._state._tls.mesh_stack``) and torchtitan keeps its own next to it
(``torchtitan.distributed.spmd_types._MESH_TLS``: ``mesh_stack``, ``dense_mesh``,
``sparse_mesh``). Non-reentrant ``torch.utils.checkpoint`` reruns the forward during
``backward()`` -- after the mesh context has been left, or on another thread (autograd's
CUDA device threads, a thread pool). There the mesh stack is empty, so
``spmd_types.assert_type(x, R)`` raises "requires an active mesh" and torchtitan's
``spmd_redistribute_per_axis`` silently skips its collectives (wrong gradients at TP > 1).
Seeds: verl #6950, torchtitan #3565.

The fix is a checkpoint ``context_fn``: it is called when the checkpointed forward runs, so it
snapshots the mesh state of *that* thread, and its recompute context installs the snapshot on
whatever thread recompute runs, restoring that thread's own state afterwards. It changes no
dispatch: recompute runs the same ops as the wrapped (selective or full) policy. It needs no
change to autograd multithreading (compare ``single_threaded_backward``).

Usage::

    checkpoint(fn, x, use_reentrant=False, context_fn=mesh_preserving_context_fn)   # full AC
    checkpoint(fn, x, use_reentrant=False,
               context_fn=functools.partial(mesh_preserving_context_fn, policy_fn))  # selective
    mesh_preserving(existing_context_fn)          # wrap any context_fn (e.g. torchtitan's)
    make_checkpoint_wrappers_mesh_preserving(model)  # after torchtitan's ac.apply(model)

Nested non-reentrant checkpoints: a wrapped level carries its mesh into the checkpoints called
inside it; a wrapped one inside an unwrapped one is refused (fixes.torchtitan.nested_checkpoints).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

from fixes.torchtitan import nested_checkpoints

__all__ = [
    "make_checkpoint_wrappers_mesh_preserving",
    "mesh_preserving",
    "mesh_preserving_context_fn",
]

ContextFn = Callable[[], tuple[Any, Any]]

# torchtitan's module holding its mesh thread-locals; looked up in sys.modules only: if
# torchtitan was never imported, nobody can have set its mesh, and importing it here would
# make this fix depend on a torchtitan that imports on the running torch (0.3.0's models
# do not on torch 2.11: DataParallelMeshDims is missing from torch.distributed.fsdp).
_TITAN_SPMD_MODULE = "torchtitan.distributed.spmd_types"
_TITAN_ATTRS = ("mesh_stack", "dense_mesh", "sparse_mesh")
_MISSING = object()
_MARK = "_stackfix_mesh_preserving"


def _spmd_tls():
    from spmd_types import _state

    # ``_state._tls.mesh_stack`` is the list spmd_types pushes meshes on (0.2.3 stores
    # MeshEntry tuples; an older revision on GitHub stored frozensets). The snapshot copies the
    # list as is, so it does not depend on what an entry looks like.
    return _state._tls


def _titan_tls():
    module = sys.modules.get(_TITAN_SPMD_MODULE)
    if module is None:
        return None
    tls = getattr(module, "_MESH_TLS", None)
    if tls is None:
        # Fail loudly: without it recompute would run without torchtitan's mesh, and its
        # spmd_redistribute_per_axis skips collectives silently (wrong gradients at TP > 1).
        raise RuntimeError(
            f"{_TITAN_SPMD_MODULE} has no _MESH_TLS (torchtitan {_version('torchtitan')}): "
            "fixes.torchtitan.mesh_checkpoint needs updating for this release"
        )
    return tls


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@dataclass(frozen=True, slots=True)
class _MeshSnapshot:
    """The mesh thread-locals of one thread at one moment (copies, never the live lists)."""

    spmd_stack: tuple
    titan: dict | None  # torchtitan's _MESH_TLS attributes, None if torchtitan is not loaded

    @classmethod
    def capture(cls, *, verify: bool = True) -> _MeshSnapshot:
        """``verify``: cross-check an empty stack against ``spmd_types.current_mesh()``; off
        where that lookup itself would be a meshless lookup in recompute (a caller's state
        saved at recompute entry)."""
        import spmd_types

        spmd_stack = tuple(getattr(_spmd_tls(), "mesh_stack", ()))
        if verify and not spmd_stack and spmd_types.current_mesh() is not None:
            # Fail loudly rather than silently stop fixing anything if spmd_types moves it.
            raise RuntimeError(
                "spmd_types reports a current mesh that is not in spmd_types._state._tls."
                f"mesh_stack (spmd_types {getattr(spmd_types, '__version__', '?')}): "
                "fixes.torchtitan.mesh_checkpoint needs updating for this release"
            )
        tls = _titan_tls()
        titan = None
        if tls is not None:
            titan = {a: getattr(tls, a, _MISSING) for a in _TITAN_ATTRS}
            if isinstance(titan["mesh_stack"], list):
                titan["mesh_stack"] = tuple(titan["mesh_stack"])
        return cls(spmd_stack, titan)

    @classmethod
    def of_mesh(cls, mesh) -> _MeshSnapshot:
        """The state ``set_current_mesh(mesh)`` (and torchtitan's stack) would give an idle
        thread, built with spmd_types' own public context manager."""
        import spmd_types

        tls = _spmd_tls()
        saved = getattr(tls, "mesh_stack", _MISSING)
        tls.mesh_stack = []
        try:
            with spmd_types.set_current_mesh(mesh):
                spmd_stack = tuple(tls.mesh_stack)
        finally:
            _restore_attr(tls, "mesh_stack", saved)
        current = cls.capture()
        titan = None
        if current.titan is not None:
            titan = dict(current.titan, mesh_stack=(mesh,))
        return cls(spmd_stack, titan)

    @property
    def has_mesh(self) -> bool:
        """A mesh is active (either stack non-empty). torchtitan's dense/sparse registrations
        alone are not an active mesh; they travel along when one is."""
        if self.spmd_stack:
            return True
        return self.titan is not None and self.titan["mesh_stack"] not in (_MISSING, ())

    def install(self) -> _MeshSnapshot:
        """Make this the calling thread's mesh state; return the state it replaced."""
        previous = _MeshSnapshot._raw()
        tls = _spmd_tls()
        tls.mesh_stack = list(self.spmd_stack)  # a fresh list: pushes in recompute stay local
        titan_tls = _titan_tls()
        if titan_tls is not None and self.titan is not None:
            for attr in _TITAN_ATTRS:
                value = self.titan[attr]
                if attr == "mesh_stack" and value is not _MISSING:
                    value = list(value)
                _restore_attr(titan_tls, attr, value)
        return previous

    @classmethod
    def _raw(cls) -> _MeshSnapshot:
        """The calling thread's state with the live list objects kept (to put back as is)."""
        spmd_stack = getattr(_spmd_tls(), "mesh_stack", _MISSING)
        tls = _titan_tls()
        titan = {a: getattr(tls, a, _MISSING) for a in _TITAN_ATTRS} if tls is not None else None
        return cls(spmd_stack, titan)

    def restore_raw(self) -> None:
        _restore_attr(_spmd_tls(), "mesh_stack", self.spmd_stack)
        tls = _titan_tls()
        if tls is not None and self.titan is not None:
            for attr in _TITAN_ATTRS:
                _restore_attr(tls, attr, self.titan[attr])


def _restore_attr(obj, attr: str, value) -> None:
    if value is _MISSING:
        if hasattr(obj, attr):
            delattr(obj, attr)
    else:
        setattr(obj, attr, value)


class _MeshReentry:
    """Recompute context: install the forward's mesh snapshot, then enter the wrapped
    recompute context; on exit leave it and put the thread's own mesh state back."""

    def __init__(self, snapshot: _MeshSnapshot, inner) -> None:
        self.snapshot = snapshot
        self.inner = inner
        self._previous: list[_MeshSnapshot] = []  # a stack: retain_graph re-enters

    def __enter__(self):
        self._previous.append(self.snapshot.install())
        nested_checkpoints.carrying.depth += 1  # checkpoints run in recompute: carry it inward
        try:
            return self.inner.__enter__()
        except BaseException:
            nested_checkpoints.carrying.depth -= 1
            self._previous.pop().restore_raw()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return self.inner.__exit__(exc_type, exc, tb)
        finally:
            nested_checkpoints.carrying.depth -= 1
            self._previous.pop().restore_raw()


class _PassThroughMode(TorchDispatchMode):
    """Runs every op unchanged. Under torch.compile, torch requires a non-default context_fn to
    return TorchDispatchModes; full AC's nullcontexts are swapped for these there."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _under_compile() -> bool:
    """True while torch.compile / AOTAutograd traces the checkpoint. There the recompute is
    part of the compiled backward graph (no Python, so no mesh lookup) and torch requires
    ``context_fn`` to return TorchDispatchModes, so the wrapped contexts pass through."""
    if torch.compiler.is_compiling():
        return True
    is_compiling = getattr(torch.utils.checkpoint, "_is_compiling", None)
    return bool(is_compiling is not None and is_compiling(None, (), {}))


def mesh_preserving(context_fn: ContextFn = noop_context_fn, *, mesh=None) -> ContextFn:
    """Wrap an existing checkpoint ``context_fn`` so its recompute context re-enters the spmd
    mesh that was current when the checkpointed forward ran (or ``mesh``, a named
    ``DeviceMesh``, if given). With no mesh at forward time the wrapped contexts are
    returned unchanged. Wrapping twice is a no-op; wrapping again with a ``mesh`` replaces the
    mesh of the one wrapping layer (never nests)."""
    if not callable(context_fn):
        raise ValueError(
            f"context_fn must be a callable returning (forward_ctx, recompute_ctx), "
            f"got {type(context_fn).__name__}"
        )
    if getattr(context_fn, _MARK, False):
        if mesh is None:
            return context_fn
        context_fn = context_fn.__wrapped__  # re-wrap the original with the given mesh
    nested_checkpoints.install(mesh_preserving, _MARK)

    def context_fn_with_mesh():
        forward_ctx, recompute_ctx = context_fn()
        if _under_compile():
            if not isinstance(forward_ctx, TorchDispatchMode):
                forward_ctx = _PassThroughMode()
            if not isinstance(recompute_ctx, TorchDispatchMode):
                recompute_ctx = _PassThroughMode()
            return forward_ctx, recompute_ctx
        snapshot = _MeshSnapshot.capture() if mesh is None else _MeshSnapshot.of_mesh(mesh)
        if not snapshot.has_mesh:
            return forward_ctx, recompute_ctx
        if nested_checkpoints.inside_unwrapped_checkpoint_forward():
            raise RuntimeError(
                "a mesh-preserving checkpoint is nested in a checkpoint that is not "
                "mesh-preserving: that one's recompute would rerun this forward without the "
                "spmd mesh. Make the outer level mesh-preserving (mesh_preserving(its "
                "context_fn), or make_checkpoint_wrappers_mesh_preserving on the model); it "
                "then carries the mesh into every level inside it"
            )
        return (nested_checkpoints.CarryInward(forward_ctx),
                _MeshReentry(snapshot, recompute_ctx))

    setattr(context_fn_with_mesh, _MARK, True)
    context_fn_with_mesh.__wrapped__ = context_fn
    return context_fn_with_mesh


def _policy_context_fn(policy) -> ContextFn:
    if policy is None:
        return lambda: (contextlib.nullcontext(), contextlib.nullcontext())
    if callable(policy) or (
        isinstance(policy, (list, tuple))
        and all(isinstance(op, torch._ops.OpOverload) for op in policy)
    ):
        return functools.partial(create_selective_checkpoint_contexts, policy)
    raise ValueError(
        "policy must be one of: None (full AC), a policy_fn(ctx, op, *args, **kwargs) -> "
        "CheckpointPolicy, or a list/tuple of torch OpOverloads to save; "
        f"got {type(policy).__name__}"
    )


def mesh_preserving_context_fn(policy=None, mesh=None):
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Returns ``(forward_ctx, recompute_ctx)`` like ``create_selective_checkpoint_contexts``:
    ``policy`` None means full AC (recompute everything), otherwise it is handed to
    ``create_selective_checkpoint_contexts`` (a policy_fn or a list of ops to save). The
    recompute context re-enters the spmd mesh current at forward time (or ``mesh``) on the
    thread that runs recompute. A stateful policy_fn (torchtitan's counts matmuls) must be
    fresh per checkpoint call: pass ``lambda: mesh_preserving_context_fn(make_policy())``.
    """
    return mesh_preserving(_policy_context_fn(policy), mesh=mesh)()


def make_checkpoint_wrappers_mesh_preserving(module: torch.nn.Module, *, mesh=None) -> int:
    """Make every non-reentrant ``CheckpointWrapper`` inside ``module`` (what torchtitan's
    FullAC / SelectiveAC ``apply`` install) use a mesh-preserving ``context_fn`` wrapping the
    one it has; returns how many wrappers now do. Idempotent.

    Reentrant wrappers cannot take a ``context_fn`` (torch rejects it), so they raise.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
    )

    count = 0
    for sub in module.modules():
        if not isinstance(sub, CheckpointWrapper):
            continue
        fn = sub.checkpoint_fn
        if sub.checkpoint_impl is CheckpointImpl.REENTRANT or not isinstance(
            fn, functools.partial
        ) or fn.keywords.get("use_reentrant", False):
            raise ValueError(
                f"{type(sub).__name__} must be non-reentrant (CheckpointImpl.NO_REENTRANT with "
                "torch.utils.checkpoint.checkpoint): reentrant checkpoint takes no context_fn"
            )
        keywords = dict(fn.keywords)
        keywords["context_fn"] = mesh_preserving(
            keywords.get("context_fn", noop_context_fn), mesh=mesh
        )
        sub.checkpoint_fn = functools.partial(fn.func, *fn.args, **keywords)
        count += 1
    return count
