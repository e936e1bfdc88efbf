"""megatron-core 0.18.x: MTP with full recompute raises ``TypeError ... padding_mask`` (verl #7326,
Megatron-LM #4933), so verl's Megatron engine cannot train MTP with full recompute there. The
plugin installs ``fixes.megatron.apply_mtp_recompute_patch`` as soon as megatron-core's
``transformer.multi_token_prediction`` is imported; on releases that are not affected it does
nothing (the patch checks the signatures, not the version).
"""

from __future__ import annotations

from types import ModuleType

from fixes.verl.patch import VerlPatch, left_alone_at_install

MODULE = "megatron.core.transformer.multi_token_prediction"


def install(module: ModuleType, version: str) -> None:
    cls = getattr(module, "MultiTokenPredictionLayer", None)
    if not isinstance(cls, type):
        left_alone_at_install("megatron's MTP full recompute", version,
                              f"{MODULE} has no MultiTokenPredictionLayer")
        return
    from fixes.megatron import apply_mtp_recompute_patch

    apply_mtp_recompute_patch(cls)


PATCH = VerlPatch(
    name="megatron-core 0.18.x: MTP full recompute takes the padding_mask its forward passes",
    module=MODULE,
    releases={"0.8.0": None, "0.9.1": None},
    install=install,
)
