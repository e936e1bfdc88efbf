"""An FP8 recompute whose "restore" restores nothing: ``get_old_fp8_meta_tensors_for_recompute``
kept references to the live amaxes and scales instead of copies, so putting the forward's
stash in place overwrote them too, and ``restore_fp8_meta_tensors`` put the stash back -- the
update made when the forward's ``fp8_autocast`` exited is lost after every recompute
(NVIDIA/TransformerEngine#1723: "copying amaxes/scales to updated amaxes/scales instead of
referencing"). Modelled on TransformerEngine's mechanism in plain torch (``_fp8_meta``).

- reference: no checkpoint;
- buggy: checkpointed, references kept aside (before #1723);
- fixed: copies kept aside (#1723).
"""

from __future__ import annotations

from recompute_bugs import Result, Variant, _fp8_meta

UPSTREAM = "NVIDIA/TransformerEngine#1723"
DIVERGES_IN = _fp8_meta.__file__  # the marked lines are the model's


def step(variant: Variant) -> Result:
    return _fp8_meta.step(checkpointing=variant is not Variant.REFERENCE, stash=True,
                          keep_copies=variant is not Variant.BUGGY)
