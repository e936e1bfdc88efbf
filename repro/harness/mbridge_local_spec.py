"""The one shim of verl's real Megatron engine: mbridge without Transformer Engine.

verl's Megatron engine (``verl/workers/engine/megatron/transformer_impl.py``, 0.8.0 / 0.9.1)
builds its model through a bridge: Megatron-Bridge (``vanilla_mbridge=False``, the default),
which requires Transformer Engine outright, or the legacy ``mbridge`` package
(``vanilla_mbridge=True``). mbridge 0.15.1 asks megatron-core for the Transformer Engine layer
spec unconditionally (``mbridge/core/llm_bridge.py``, ``_get_transformer_layer_spec``:
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``); without TE that spec
fails (megatron-core 0.16.1 ``gpt_layer_specs.py``: ``NameError: name 'TENorm' is not
defined``). Neither the CPU machines nor the H200 image have TE: its core wheel is ~276 MB and
its torch extension is source only.

``use_local_spec_in_mbridge()`` makes mbridge run on megatron-core's own (local) spec, three
places, each only where the local spec differs from TE's:

1. the layer spec: mbridge's call gets ``use_transformer_engine=False``;
2. weight names: the local spec names two norms and the MoE experts differently from TE's
   (``input_layernorm`` / ``pre_mlp_layernorm`` vs ``linear_qkv.layer_norm_weight`` /
   ``linear_fc1.layer_norm_weight``; ``experts.local_experts.<e>.linear_fc1`` vs
   ``experts.linear_fc1.weight<e>``); a name mbridge's own table does not know is looked up as
   its TE twin (only names it would reject: no known name changes meaning);
3. the attention mask: verl's bshd path (``preprocess_bshd_engine``, ``use_remove_padding=
   False``) passes a ``[b, s]`` padding mask, right-padded, that megatron's local
   ``DotProductAttention`` cannot broadcast (it takes ``[b, 1, s, s]``, True = masked). The
   shim puts megatron's causal mask in place of a 2-D one there: with right
   padding no valid token attends to a pad, and valid positions get the logits of the
   unpadded sequences (tests/test_verl_engine.py checks them against the Hugging Face model).
   verl's thd path (packed sequences) has no local equivalent: it needs TE's attention.

Nothing of the recompute under test changes: full recompute still goes through megatron-core's
``tensor_parallel.checkpoint`` (CheckpointFunction) per layer, with verl's mask tensor among
its inputs as verl passes it. Process-wide and permanent: install it in a child process only.
"""

from __future__ import annotations

import functools
import re

import torch

_MARK = "__stackfix_local_spec_shim__"

# local-spec parameter name -> its Transformer Engine twin, as mbridge's tables name it
_TE_TWINS = (
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.pre_mlp_layernorm\.weight$"), ".mlp.linear_fc1.layer_norm_weight"),
    (re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$"),
     r".mlp.experts.\2.weight\1"),
)


def te_twin(name: str) -> str | None:
    """The Transformer Engine spec's name of local-spec parameter ``name`` (None: the same)."""
    for pattern, replacement in _TE_TWINS:
        if pattern.search(name):
            return pattern.sub(replacement, name)
    return None


def _marked(function):
    setattr(function, _MARK, True)
    return function


def _local_spec(original):
    @functools.wraps(original)
    def get_gpt_decoder_block_spec(config, use_transformer_engine=True, **kwargs):
        return original(config, use_transformer_engine=False, **kwargs)

    return _marked(get_gpt_decoder_block_spec)


def _te_twin_names(original):
    @functools.wraps(original)
    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name):
        try:
            return original(self, mcore_weights_name)
        except NotImplementedError:
            twin = te_twin(mcore_weights_name)
            if twin is None:
                raise
            return original(self, twin)

    return _marked(_weight_name_mapping_mcore_to_hf)


def _causal_for_padding_mask(original):
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:
            # verl's [b, s] right-padding mask -> megatron's causal mask ([1, 1, sq, sk], True =
            # masked, as megatron.core.transformer.utils.get_default_causal_mask builds it, but
            # on the query's device: that one allocates on CUDA)
            sq, sk = query.shape[0], key.shape[0]
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(
                1).view(1, 1, sq, sk)
        return original(self, query, key, value, attention_mask, *args, **kwargs)

    return _marked(forward)


def use_local_spec_in_mbridge() -> None:
    """Install the three parts (idempotent). Raises ImportError without mbridge."""
    from mbridge.core import bridge, llm_bridge
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for owner, name, wrap in (
        (llm_bridge, "get_gpt_decoder_block_spec", _local_spec),
        (bridge.Bridge, "_weight_name_mapping_mcore_to_hf", _te_twin_names),
        (DotProductAttention, "forward", _causal_for_padding_mask),
    ):
        current = getattr(owner, name)
        if not getattr(current, _MARK, False):
            setattr(owner, name, wrap(current))
