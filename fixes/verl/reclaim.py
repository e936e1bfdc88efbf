"""Crash 2: verl's Megatron engine installs our recompute reclaim instead of its own.

verl replaces megatron-core's ``CheckpointFunction.backward`` with a copy that ``resize_(0)``\\ s
every requires-grad checkpoint input and its grad (the MoE residual leak, Megatron-LM #3221). A
chunk view of a tensor another node saved for backward loses its storage under that reader:
SIGSEGV on CPU, an illegal memory access on CUDA (verl #7328). verl's Megatron engine calls
``apply_patch_megatron_recomputation_backward`` in its ``__init__`` whenever CUDA is available,
in every worker, importing it from ``verl.models.mcore.patch`` at call time
(``verl/workers/engine/megatron/transformer_impl.py``, 0.8.0 and 0.9.1). So the plugin replaces
that module attribute: whoever calls it, whenever, gets ``fixes.megatron``'s alias-aware
reclaim (which frees the same leaked copies, never a storage something can still read). A verl
reclaim installed before the plugin loaded is replaced at once (the reclaim replaces a foreign
backward, never wraps it). verl's own function is kept as ``__wrapped__``, never called.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

from fixes.verl.patch import VerlPatch, left_alone_at_install, logger

MODULE = "verl.models.mcore.patch"
FUNCTION = "apply_patch_megatron_recomputation_backward"
_MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"
_MARK = "_stackfix_installs_alias_aware_reclaim"


def _ours(verl_function):
    @functools.wraps(verl_function)
    def apply_patch_megatron_recomputation_backward():
        # Instead of verl's resize_(0) of every input (verl #7328): the alias-aware reclaim.
        from fixes.megatron import apply_recompute_reclaim_patch

        if apply_recompute_reclaim_patch():
            logger.info("stackfix verl plugin: verl's %s installed the alias-aware reclaim",
                        FUNCTION)

    setattr(apply_patch_megatron_recomputation_backward, _MARK, True)
    return apply_patch_megatron_recomputation_backward


def replace_installed_verl_reclaim() -> bool:
    """If megatron-core is loaded and a foreign reclaim (verl's) is on its CheckpointFunction,
    put ours in its place. True if it did. megatron not imported: nothing can be installed."""
    if _MEGATRON_RANDOM not in sys.modules:
        return False
    from fixes.megatron import apply_recompute_reclaim_patch
    from fixes.megatron.reclaim import installed_reclaim

    if not (installed_reclaim() or "").startswith("foreign:"):
        return False
    return apply_recompute_reclaim_patch()


def install(module: ModuleType, version: str) -> None:
    verl_function = getattr(module, FUNCTION, None)
    if verl_function is None:
        left_alone_at_install("the Megatron recompute reclaim", version,
                              f"{MODULE} has no {FUNCTION}")
        return
    if not getattr(verl_function, _MARK, False):
        setattr(module, FUNCTION, _ours(verl_function))
    replace_installed_verl_reclaim()


PATCH = VerlPatch(
    name="crash 2: verl's Megatron recompute reclaim -> fixes.megatron's alias-aware one",
    module=MODULE,
    releases={"0.8.0": None, "0.9.1": None},
    install=install,
)
