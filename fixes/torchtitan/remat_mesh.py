"""Mesh-safe recompute for torch_remat, the activation checkpointing torchtitan moves to
(torchtitan #4497; #4614 adds a mesh-restoring recompute hook there).

Why: ``torch_remat.checkpoint`` replays the block inside ``backward()`` like
``torch.utils.checkpoint`` does, so the thread-local spmd mesh is gone there too (measured with
torch-remat 0.2.2: ``SpmdTypeError: ... requires an active mesh``). It builds its own
``context_fn`` and accepts none, so ``mesh_preserving_context_fn`` cannot be handed to it. It
does take ``recompute_state_hooks`` (snapshot on the forward, restore around the replay, the
caller's state put back after): ``MeshRecomputeStateHook`` carries the mesh through that door.

Usage::

    y = mesh_preserving_remat_checkpoint(region_name="layers.0")(block)(x)
    # or, with torch_remat directly:
    y = torch_remat.checkpoint(region_name="layers.0",
                               recompute_state_hooks=(MeshRecomputeStateHook(),))(block)(x)
"""

from __future__ import annotations

import functools
import inspect
from importlib import metadata

import torch

from fixes.torchtitan.mesh_checkpoint import _MeshSnapshot

__all__ = ["MeshRecomputeStateHook", "RematUnsupported", "mesh_preserving_remat_checkpoint"]


class RematUnsupported(RuntimeError):
    """The installed torch_remat offers no way to carry the mesh into its recompute."""


class MeshRecomputeStateHook:
    """A ``torch_remat.RecomputeStateHook``: ``snapshot`` copies the calling thread's spmd (and
    torchtitan) mesh stacks, ``restore`` makes a snapshot the running thread's state."""

    def snapshot(self) -> _MeshSnapshot:
        import torch_remat

        # At recompute entry torch_remat saves the replaying thread's own state (often no
        # mesh): copy it without asking spmd_types for a mesh (mesh_sanitizer would flag that).
        return _MeshSnapshot.capture(verify=not torch_remat.is_recomputing())

    def restore(self, state: _MeshSnapshot) -> None:
        state.install()


def _remat_version() -> str:
    try:
        return metadata.version("torch-remat")
    except metadata.PackageNotFoundError:
        return "?"


def mesh_preserving_remat_checkpoint(**remat_kwargs):
    """``torch_remat.checkpoint(**remat_kwargs)`` whose replay re-enters the forward's mesh.

    Returns the same decorator (``(...)(fn)(*args)``). Under ``torch.compile`` the hook is left
    out: torch_remat rejects state hooks there, and the compiled recompute runs no Python that
    could look the mesh up. Raises ``RematUnsupported`` naming the version if the installed
    torch_remat has no ``recompute_state_hooks``."""
    import torch_remat

    if "recompute_state_hooks" not in inspect.signature(torch_remat.checkpoint).parameters:
        raise RematUnsupported(
            f"torch_remat {_remat_version()}: checkpoint() takes no recompute_state_hooks, so "
            "fixes.torchtitan cannot carry the spmd mesh into its recompute (needs torch-remat "
            "with RecomputeStateHook, e.g. 0.2.2)"
        )
    hooks = tuple(remat_kwargs.pop("recompute_state_hooks", ()))
    eager = torch_remat.checkpoint(
        **remat_kwargs, recompute_state_hooks=(*hooks, MeshRecomputeStateHook())
    )
    compiled = torch_remat.checkpoint(**remat_kwargs, recompute_state_hooks=hooks)

    def decorate(function):
        eager_fn, compiled_fn = eager(function), compiled(function)

        @functools.wraps(function)
        def checkpointed(*args, **kwargs):
            run = compiled_fn if torch.compiler.is_compiling() else eager_fn
            return run(*args, **kwargs)

        return checkpointed

    return decorate
