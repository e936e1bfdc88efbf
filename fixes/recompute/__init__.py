"""Activation-checkpoint regions that replay their forward: state a region reads or updates
(attributes of modules or holder objects, buffers, counters) captured when its forward starts
and put in place for its recompute, then restored (Megatron-LM #6793, torchtitan #4568)."""

from fixes.recompute.state import (
    RecomputeState,
    managed_storages,
    state_preserving,
    state_preserving_context_fn,
)

__all__ = ["RecomputeState", "managed_storages", "state_preserving", "state_preserving_context_fn"]
