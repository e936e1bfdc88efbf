"""An FP8 recompute that reads the scales the end of the forward's ``fp8_autocast`` already
updated (NVIDIA/TransformerEngine#24: "ensures that the 2 forward phases (initial and
recompute) see the same scaling factors and amaxes to ensure identical numerics").

Delayed scaling updates a layer's FP8 scale from its amax history when ``fp8_autocast`` exits,
between the forward and backward; a recompute that quantizes with the live scale quantizes
with another one than its forward did, and records its amax into the rolled history.
Modelled on TransformerEngine's mechanism in plain torch (``_fp8_meta``; TE is not installed).

- reference: no checkpoint;
- buggy: checkpointed, the forward's meta not stashed (before #24);
- fixed: stashed, put in place for the recompute and restored after (copies kept aside).
"""

from __future__ import annotations

from recompute_bugs import Result, Variant, _fp8_meta

UPSTREAM = "NVIDIA/TransformerEngine#24"
DIVERGES_IN = _fp8_meta.__file__  # the marked lines are the model's


def step(variant: Variant) -> Result:
    return _fp8_meta.step(checkpointing=variant is not Variant.REFERENCE,
                          stash=variant is not Variant.BUGGY, keep_copies=True)
