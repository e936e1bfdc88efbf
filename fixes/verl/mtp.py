"""Crash 3: verl 0.8.0's MTP postprocess forwards ``mhc_multistream`` (Megatron-LM dev's mHC).

verl's ``patch_postprocess`` (``verl/models/mcore/mtp_patch.py``) replaces each model's
``GPTModel._postprocess`` with verl's copy of an older body. 0.8.0's copy neither takes nor
forwards ``mhc_multistream``, so on Megatron-LM dev with hyper-connections and MTP the MTP layer
views the contracted ``[s, b, h]`` states as ``[s, b, n, h]`` and fails (verl #7328). verl 0.9.x
forwards it: left alone there.

The plugin installs ``fixes.megatron.apply_mtp_postprocess_patch`` on megatron's ``GPTModel``
once ``verl.models.mcore.mtp_patch`` is imported (it imports GPTModel itself, so megatron is
loaded then). That descriptor wraps per-instance replacements assigned before or after it, so
verl's copy, assigned later per model, is wrapped too and runs as shipped.
"""

from __future__ import annotations

from types import ModuleType

from fixes.verl.patch import VerlPatch, left_alone_at_install

MODULE = "verl.models.mcore.mtp_patch"


def install(module: ModuleType, version: str) -> None:
    gpt_model = getattr(module, "GPTModel", None)
    if not isinstance(gpt_model, type):
        left_alone_at_install("the MTP postprocess", version, f"{MODULE} has no GPTModel")
        return
    from fixes.megatron import apply_mtp_postprocess_patch

    apply_mtp_postprocess_patch(gpt_model)


PATCH = VerlPatch(
    name="crash 3: verl's MTP postprocess forwards mhc_multistream",
    module=MODULE,
    releases={"0.8.0": None, "0.9.1": "verl 0.9.1 already forwards mhc_multistream"},
    install=install,
)
