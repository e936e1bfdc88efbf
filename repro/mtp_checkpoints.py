"""How megatron-core's MTP layer makes its checkpoint, in each form verl's reclaim meets it.

verl 0.9.1's reclaim skips a checkpoint when a closure cell of its ``run_function`` is an object
of class ``MultiTokenPredictionLayer``; whether that fires depends on how the checkpoint's
``run_function`` was made, which changed between megatron-core releases and verl's own patch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["MTP_CHECKPOINTS", "megatron_mtp_checkpoint"]

MTP_CHECKPOINTS = ("closure", "bound-method", "verl-run")


def megatron_mtp_checkpoint(form: str) -> Callable[..., torch.Tensor]:
    """``checkpoint(layer, part)`` through megatron-core's ``tensor_parallel.checkpoint``, the
    ``run_function`` made as upstream makes it (``MTP_CHECKPOINTS``):

    * ``closure``: Megatron-LM core_v0.19.0+ ``MultiTokenPredictionLayer._checkpointed_forward``:
      ``custom_forward`` calls ``self._proj_and_transformer_layer`` (the layer is a closure cell);
    * ``bound-method``: megatron-core 0.16.1: ``forward`` passes the bound method
      ``self._proj_and_transformer_layer``; ``_checkpointed_forward`` hands it to
      ``tensor_parallel.checkpoint`` unchanged;
    * ``verl-run``: verl 0.9.1's ``_patched_checkpointed_forward`` (verl/models/mcore/mtp_patch.py)
      on that bound method — its ``run`` closes over the method and two spec lists.
    """
    from megatron.core import tensor_parallel

    if form not in MTP_CHECKPOINTS:
        raise ValueError(f"unknown MTP checkpoint form {form!r}; allowed: {MTP_CHECKPOINTS}")
    if form == "closure":
        def checkpoint(layer, part):
            def custom_forward(hidden_states):
                return layer._proj_and_transformer_layer(hidden_states)

            return tensor_parallel.checkpoint(custom_forward, False, part)
    elif form == "bound-method":
        def checkpoint(layer, part):
            return tensor_parallel.checkpoint(layer._proj_and_transformer_layer, False, part)
    else:
        from repro.verl_release import import_verl

        mtp_patch = import_verl("0.9.1", "verl.models.mcore.mtp_patch")

        def checkpoint(layer, part):
            return mtp_patch._patched_checkpointed_forward(
                layer, layer._proj_and_transformer_layer, hidden_states=part)
    return checkpoint
