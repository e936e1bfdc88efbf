"""Fixes for megatron-core. Importing this package needs only torch: megatron itself is
imported inside the functions that patch it."""

from fixes.megatron.mtp_postprocess import (
    apply_mtp_postprocess_patch,
    remove_mtp_postprocess_patch,
    wrap_postprocess,
)
from fixes.megatron.mtp_recompute import (
    MTPRecomputeRefused,
    apply_mtp_recompute_patch,
    mtp_recompute_needs_patch,
    remove_mtp_recompute_patch,
)
from fixes.megatron.output_discard import (
    apply_output_discard_patch,
    installed_output_discard,
    kept_outputs,
    remove_output_discard_patch,
)
from fixes.megatron.reclaim import (
    ReclaimAction,
    ReclaimEvent,
    apply_recompute_reclaim_patch,
    installed_reclaim,
    recompute_reclaim_events,
    remove_recompute_reclaim_patch,
)
from fixes.megatron.storage import is_storage_exclusive

__all__ = [
    "MTPRecomputeRefused",
    "ReclaimAction",
    "ReclaimEvent",
    "apply_mtp_postprocess_patch",
    "apply_mtp_recompute_patch",
    "apply_output_discard_patch",
    "apply_recompute_reclaim_patch",
    "installed_output_discard",
    "installed_reclaim",
    "is_storage_exclusive",
    "kept_outputs",
    "mtp_recompute_needs_patch",
    "recompute_reclaim_events",
    "remove_mtp_postprocess_patch",
    "remove_mtp_recompute_patch",
    "remove_output_discard_patch",
    "remove_recompute_reclaim_patch",
    "wrap_postprocess",
]
