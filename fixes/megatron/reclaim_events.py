"""What a recompute reclaim did, as events: ``recompute_reclaim_events()`` collects the
``ReclaimEvent`` s of every reclaim (stackfix's, and the harness's unfixed ones) made inside the
block; ``ReclaimAction`` says what each means."""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fixes.megatron.storage import storage_key

__all__ = ["ReclaimAction", "ReclaimEvent", "emit", "recompute_reclaim_events", "storage_of"]


class ReclaimAction(enum.StrEnum):
    """What a reclaim did with one checkpoint input (``role`` input) or checkpoint call
    (``role`` checkpoint); one meaning each."""

    #: The recompute read the input through the identity node, and once the checkpoint's
    #: backward had returned nothing referred to the recompute's view of it: the recompute keeps
    #: none of its memory (a leaked recompute graph holds the stand-in).
    RELEASED = "released"
    #: Read through the identity node, and after the backward something outside the recompute
    #: graph still held the recompute's view (a Python reference, a node that saved it, a view
    #: of it): that holder keeps it, readable and unchanged, until it lets go.
    HELD = "held"
    #: A requires-grad input the reclaim does not route (a tensor subclass, a non-strided
    #: layout, a recompute run with grad disabled): the recompute got megatron's own detached
    #: copy, with megatron's semantics, leak included.
    PASSED = "passed"
    #: Role checkpoint: the backward did not call ``ctx.run_function`` exactly once, so which
    #: call's inputs are the checkpoint's is not known: megatron's own result was returned.
    UNOBSERVED = "unobserved"
    #: A storage resized to zero bytes: verl's mechanism, in the harness's unfixed reclaims
    #: only. stackfix's reclaim never emits it.
    RESIZED = "resized"


@dataclass(frozen=True)
class ReclaimEvent:
    """One decision of a reclaim about one checkpoint input (or call)."""

    action: ReclaimAction
    role: str  # "input" | "checkpoint"
    storage: int  # StorageImpl address at the decision: compare with storage.storage_key
    nbytes: int


_observers: list[list[ReclaimEvent]] = []
_observers_lock = threading.Lock()


@contextmanager
def recompute_reclaim_events() -> Iterator[list[ReclaimEvent]]:
    """Collect the ReclaimEvents of every reclaim (any variant) made inside the block."""
    events: list[ReclaimEvent] = []
    with _observers_lock:
        _observers.append(events)
    try:
        yield events
    finally:
        with _observers_lock:
            _observers.remove(events)


def emit(action: ReclaimAction, role: str, storage: int = 0, nbytes: int = 0) -> None:
    """Record one decision for every ``recompute_reclaim_events`` block."""
    if not _observers:
        return
    event = ReclaimEvent(ReclaimAction(action), role, storage, nbytes)
    with _observers_lock:
        for events in _observers:
            events.append(event)


def storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    return storage_key(tensor), tensor.untyped_storage().nbytes()
