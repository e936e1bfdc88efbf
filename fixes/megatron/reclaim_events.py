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

    #: Once the checkpoint's backward had returned, nothing but the recompute graph held the
    #: recompute's detached copy of the input (or nothing at all): the copy keeps none of the
    #: input's memory and no gradient (a leaked recompute graph holds a released copy).
    RELEASED = "released"
    #: After the backward something besides the recompute graph held the detached copy (a
    #: Python or weak reference, a node that saved it, a view of it, a hook that gets it): it is
    #: left exactly as megatron leaves it, readable and unchanged, and so is megatron's leak.
    HELD = "held"
    #: A requires-grad input the reclaim does not examine (a tensor subclass, a non-strided
    #: layout): megatron's own semantics, leak included.
    PASSED = "passed"
    #: Role checkpoint: the backward never called ``ctx.run_function``: there was no copy to
    #: examine.
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
