"""The recompute leak the reclaim exists for, as a checkpointed module reproduces it.

Megatron-LM #3221 / #5197 (MoE ``unpermute`` intermediates) and #5227 (DeepEP's
``token_probs``): during full recompute a module keeps a recompute *intermediate* on itself
until its next forward. That tensor's autograd graph ends at the checkpoint's detached input
(its ``AccumulateGrad`` node), so the input and its ``.grad`` stay allocated after backward —
held by the graph, not by any Python name. verl's reclaim (verl #5251) frees them.

``ModuleStateLeak`` is that mechanism; ``PythonCycle`` is the other shape a leak can take (an
unreachable reference cycle holding the detached input itself), which only the cycle
collector frees. ``storage_gone`` tells, through a weak reference, whether a storage's memory
went (freed, or shrunk to nothing by a ``resize_(0)``) without reading it.
"""

from __future__ import annotations

import torch


class ModuleStateLeak:
    """Keeps every recompute intermediate handed to ``keep`` until ``clear`` (the next step)."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def keep(self, intermediate: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # the recompute (the checkpointed forward runs in no_grad)
            self.kept.append(intermediate)

    def clear(self) -> None:
        self.kept.clear()


class PythonCycle:
    """An object in a reference cycle holding ``t``; unreachable once its creator drops it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.me, self.t = self, t


def storage_gone(weak_storage: int) -> bool:
    """Has the storage behind ``weak_storage`` (``UntypedStorage._weak_ref()``) been freed, or
    shrunk to nothing?"""
    if torch.UntypedStorage._expired(weak_storage):
        return True
    return torch.UntypedStorage._new_with_weak_ptr(weak_storage).nbytes() == 0
