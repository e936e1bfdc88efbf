"""Crash 2: verl's Megatron engine installs our recompute reclaim instead of its own.

verl replaces megatron-core's ``CheckpointFunction.backward`` with a copy that ``resize_(0)``\\ s
every requires-grad checkpoint input and its grad (the MoE residual leak, Megatron-LM #3221). A
chunk view of a tensor another node saved for backward loses its storage under that reader:
SIGSEGV on CPU, an illegal memory access on CUDA (verl #7328). verl's Megatron engine calls
``apply_patch_megatron_recomputation_backward`` in its ``__init__`` whenever CUDA is available,
in every worker, importing it from ``verl.models.mcore.patch`` at call time
(``verl/workers/engine/megatron/transformer_impl.py``, 0.8.0 and 0.9.1). So the plugin replaces
that module attribute: whoever calls it, whenever, gets ``fixes.megatron``'s reclaim (whose
recompute graphs hold none of their inputs, so the leak keeps nothing and nothing is freed
under a reader). A verl reclaim installed before the plugin loaded is replaced at once (the
reclaim replaces a foreign backward, never wraps it). verl's own function is kept as
``__wrapped__``, never called. And as soon as megatron-core's ``tensor_parallel.random`` is
imported the plugin keeps a reference to megatron's own backward
(``fixes.megatron.pristine.remember_own_backward``), so that it is the function the process
imported that the reclaim wraps, whatever verl assigns later.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

from fixes.verl.patch import VerlPatch, left_alone_at_install, logger
from fixes.verl.post_import import when_imported

MODULE = "verl.models.mcore.patch"
FUNCTION = "apply_patch_megatron_recomputation_backward"
_MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"
_MARK = "_stackfix_installs_its_reclaim"


def _ours(verl_function):
    @functools.wraps(verl_function)
    def apply_patch_megatron_recomputation_backward():
        # Instead of verl's resize_(0) of every input (verl #7328): stackfix's reclaim.
        from fixes.megatron import apply_recompute_reclaim_patch

        if apply_recompute_reclaim_patch():
            logger.info("stackfix verl plugin: verl's %s installed stackfix's recompute reclaim",
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


def _remember_megatron_backward(random_module: ModuleType) -> None:
    from fixes.megatron.pristine import remember_own_backward

    remember_own_backward(random_module.CheckpointFunction)


def install(module: ModuleType, version: str) -> None:
    # megatron's own backward, kept while it is still in place (now, or at megatron's import)
    when_imported(_MEGATRON_RANDOM, _remember_megatron_backward)
    verl_function = getattr(module, FUNCTION, None)
    if verl_function is None:
        left_alone_at_install("the Megatron recompute reclaim", version,
                              f"{MODULE} has no {FUNCTION}")
        return
    if not getattr(verl_function, _MARK, False):
        setattr(module, FUNCTION, _ours(verl_function))
    replace_installed_verl_reclaim()


PATCH = VerlPatch(
    name="crash 2: verl's Megatron recompute reclaim -> fixes.megatron's",
    module=MODULE,
    releases={"0.8.0": None, "0.9.1": None},
    install=install,
)
