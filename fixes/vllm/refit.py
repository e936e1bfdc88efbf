"""Load one bucket of refit weights into a vLLM model, the way an RL trainer's weight sync must.

Two things around ``model.load_weights``:
- the MTP completeness check is off (``mtp_completeness_check_disabled``): a bucket is not the
  whole checkpoint (verl #7328);
- parameters that vLLM re-created as plain ``nn.Parameter`` after loading remember their vLLM
  parameter class in ``subclass_type``; some weight loaders dispatch on that class, so it is put
  back for the load (verl's ``load_quanted_weights``) and the plain class restored afterwards —
  also when loading raises, which verl's loop did not do (a failed bucket left parameters with the
  wrong class for the rest of the run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from fixes.vllm.mtp_check import mtp_completeness_check_disabled

SUBCLASS_ATTR = "subclass_type"


@contextlib.contextmanager
def parameter_subclasses_restored(model: nn.Module) -> Iterator[list[nn.Parameter]]:
    """Give every parameter with a ``subclass_type`` that class for the duration; the original
    classes come back on exit, exception or not. Yields the parameters it swapped."""
    swapped: list[tuple[nn.Parameter, type]] = []
    try:
        for param in model.parameters():
            target = getattr(param, SUBCLASS_ATTR, None)
            if target is None or type(param) is target:
                continue
            original = type(param)
            param.__class__ = target
            swapped.append((param, original))
        yield [p for p, _ in swapped]
    finally:
        for param, original in reversed(swapped):
            param.__class__ = original


def load_refit_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
    """``model.load_weights(weights)`` for one refit bucket: MTP completeness check off, vLLM
    parameter classes in place, everything restored after. Returns what ``load_weights`` returns
    (vLLM: the set of loaded parameter names)."""
    with mtp_completeness_check_disabled(), parameter_subclasses_restored(model):
        return model.load_weights(weights)
