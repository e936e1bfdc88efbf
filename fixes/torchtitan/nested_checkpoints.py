"""Nested non-reentrant checkpoints and the spmd mesh (used by fixes.torchtitan.mesh_checkpoint).

Why: when a checkpointed function calls ``checkpoint`` itself, the inner checkpoint's recompute
runs later in the backward pass, outside the outer one's recompute context. A mesh-preserving
outer level therefore does not reach an inner level whose context_fn is plain, and the inner
recompute runs without the mesh (``SpmdTypeError``, or torchtitan's collectives skipped). The
other way round cannot work at all: an outer level that is not mesh-preserving reruns the inner
forward, in its recompute, without the mesh.

Contract:

* a wrapped level carries its mesh inward: while its forward (``CarryInward``) or its recompute
  runs on a thread (``carrying.depth`` > 0), a non-reentrant checkpoint called there gets a
  mesh-preserving context_fn wrapping its own. For that, ``install`` wraps
  ``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` once per process: torch's
  ``checkpoint`` calls it by its module-global name, the one place every non-reentrant
  checkpoint (CheckpointWrapper included) goes through. Outside a wrapped level the wrapper only
  forwards its arguments;
* ``inside_unwrapped_checkpoint_forward`` tells a mesh-preserving context_fn that it was called
  inside the forward of a checkpoint that is not: the caller refuses that nesting.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
from torch.utils.checkpoint import noop_context_fn

__all__ = ["CarryInward", "carrying", "inside_unwrapped_checkpoint_forward", "install"]


class _Carrying(threading.local):
    depth = 0  # how many mesh-preserving forwards / recomputes this thread is inside


carrying = _Carrying()


class CarryInward:
    """Around a wrapped level's forward context: checkpoints called in it are made
    mesh-preserving."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __enter__(self):
        carrying.depth += 1
        try:
            return self.inner.__enter__()
        except BaseException:
            carrying.depth -= 1
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return self.inner.__exit__(exc_type, exc, tb)
        finally:
            carrying.depth -= 1


_install_lock = threading.Lock()


def install(make_mesh_preserving: Callable, mark: str) -> None:
    """Wrap torch's non-reentrant checkpoint generator, once per process: inside a wrapped
    level, a context_fn without the attribute ``mark`` is replaced by
    ``make_mesh_preserving(context_fn)``."""
    module = torch.utils.checkpoint
    if getattr(module._checkpoint_without_reentrant_generator, mark, False):
        return  # installed (the common case: this runs on every mesh_preserving call)
    with _install_lock:
        original = module._checkpoint_without_reentrant_generator
        if getattr(original, mark, False):
            return

        @functools.wraps(original)
        def _nested_checkpoint_generator(fn, preserve_rng_state=True,
                                         context_fn=noop_context_fn, *args, **kwargs):
            if carrying.depth and not getattr(context_fn, mark, False):
                context_fn = make_mesh_preserving(context_fn)
            return original(fn, preserve_rng_state, context_fn, *args, **kwargs)

        setattr(_nested_checkpoint_generator, mark, True)
        module._checkpoint_without_reentrant_generator = _nested_checkpoint_generator


def inside_unwrapped_checkpoint_forward() -> bool:
    """Called from a context_fn: is this checkpoint nested in the forward of another
    non-reentrant checkpoint that is not mesh-preserving? (The top saved-tensor hook is then that
    checkpoint's pack hook, torch/utils/checkpoint.py ``_checkpoint_hook``.)"""
    if carrying.depth:
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = top[0] if top else None
    return (getattr(pack, "__module__", None) == "torch.utils.checkpoint"
            and getattr(pack, "__qualname__", "").startswith("_checkpoint_hook."))
