"""Keep autograd's backward (and so checkpoint recompute) on the calling thread.

Why: with CUDA tensors the autograd engine runs backward on per-device worker threads, where
thread-local state such as spmd_types' mesh stack is empty, so checkpoint recompute raises
"requires an active mesh" (verl #6950, torchtitan #3565). The upstream fix calls
``torch.autograd.set_multithreading_enabled(False)`` once at engine init, but that setting is
thread-local: a training step on another thread (a Ray actor's executor, a thread pool) still
gets the device threads. This context manager sets it on the thread that runs the step, for
the step's duration, and puts the previous setting back afterwards, exception or not.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

__all__ = ["SingleThreadedBackwardUnavailable", "single_threaded_backward"]


class SingleThreadedBackwardUnavailable(UserWarning):
    """This torch has no ``torch.autograd.set_multithreading_enabled`` (added in torch 2.5):
    backward may still run on device threads; use ``mesh_preserving_context_fn`` instead."""


@contextlib.contextmanager
def single_threaded_backward() -> Iterator[None]:
    """Autograd multithreading off for the calling thread inside the block, restored after.

    On a torch without ``set_multithreading_enabled`` this warns
    (``SingleThreadedBackwardUnavailable``) and runs the block unchanged.
    """
    set_enabled = getattr(torch.autograd, "set_multithreading_enabled", None)
    if set_enabled is None:
        warnings.warn(
            "torch.autograd.set_multithreading_enabled is missing (torch < 2.5): backward "
            "may run on autograd device threads; single_threaded_backward() does nothing",
            SingleThreadedBackwardUnavailable,
            stacklevel=3,
        )
        yield
        return
    # set_multithreading_enabled(False) switches at construction and restores the value it
    # saw then in __exit__ (thread-local both times), also when the block raises.
    with set_enabled(False):
        yield
