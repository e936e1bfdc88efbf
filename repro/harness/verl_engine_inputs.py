"""What verl's own Megatron engine is fed in repro/verl_engine.py: the tiny Hugging Face model
directory (config, a word-level tokenizer, random weights; nothing downloaded) in two kinds and
sizes, and the SFT batch and loss verl's SFT trainer hands the engine, built with verl's own
helpers. verl and transformers are imported inside the functions that use them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

KINDS = ("dense", "moe")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # dense intermediate size; the MoE expert size is ffn // 4
    experts: int
    vocab: int
    seq_len: int
    batch: int


SIZES = {
    # CI: a few layers, small enough for a 2-core machine
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, experts=4, vocab=128,
                      seq_len=16, batch=4),
    # the H200 run: the size of benchmarks.megatron_scale's MoE cell (H=1024, S=2048, 4 layers)
    "bench": ModelSize(hidden=1024, layers=4, heads=16, kv_heads=8, ffn=4096, experts=8,
                       vocab=1024, seq_len=2048, batch=2),
}


# --- the model directory ------------------------------------------------------------------------


def hf_config(kind: str, size: ModelSize) -> dict:
    """config.json of the tiny model: Qwen2 (dense) or Qwen3-MoE, untied embeddings."""
    common = dict(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                  num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                  intermediate_size=size.ffn, max_position_embeddings=max(256, size.seq_len),
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "dense":
        return dict(common, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    if kind == "moe":
        return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    head_dim=size.hidden // size.heads, num_experts=size.experts,
                    num_experts_per_tok=2, moe_intermediate_size=size.ffn // 4,
                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                    output_router_logits=False, router_aux_loss_coef=0.001)
    raise ValueError(f"unknown kind {kind!r}; allowed: {KINDS}")


def write_tiny_model(root: Path, kind: str, size: ModelSize, seed: int = 0) -> Path:
    """``root/kind``: config.json, a word-level tokenizer (``<pad> <s> </s> <unk> t0 t1 ...``)
    and random bf16 weights from the Hugging Face model class (safetensors)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"t{i}" for i in range(size.vocab - 4)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    (path / "config.json").write_text(json.dumps(hf_config(kind, size), indent=1))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                             dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


# --- verl's SFT batch and loss ------------------------------------------------------------


def sft_samples(size: ModelSize, seed: int = 1) -> list[dict]:
    """``size.batch`` samples as verl 0.9.1's SFT dataset returns them in its default pad mode,
    ``no_padding`` (``verl/utils/dataset/multiturn_sft_dataset.py``:404-421: 1-D
    ``input_ids``, ``position_ids`` = ``arange(len)`` (:362), ``loss_mask`` 0 on the prompt, 1
    on the response, the dtype of the attention mask (:235-239)): rows of different lengths,
    the first ``size.seq_len`` long, each one's second half the response."""
    generator = torch.Generator().manual_seed(seed)
    b, s = size.batch, size.seq_len
    samples = []
    for row in range(b):
        n = s - (row * s) // (4 * b)
        prompt = n // 2
        samples.append({
            "input_ids": torch.randint(4, size.vocab, (n,), generator=generator),
            "position_ids": torch.arange(n, dtype=torch.long),
            "loss_mask": torch.cat([torch.zeros(prompt, dtype=torch.long),
                                    torch.ones(n - prompt, dtype=torch.long)]),
        })
    return samples


def sft_batch(samples: list[dict], model_config, engine_config, global_batch_size: int):
    """The TensorDict verl 0.9.1's SFT trainer hands ``engine.train_batch``, built with verl's
    own helpers, as ``SFTTrainer`` and ``TrainingWorker`` build it (one data-parallel rank):

    * ``SFTTensorCollator(no_padding)`` (the trainer's collate_fn,
      ``verl/trainer/sft_trainer.py``:242; ``verl/utils/dataset/dataset_utils.py``:52-80):
      jagged nested ``input_ids`` / ``position_ids`` / ``loss_mask``, the layout ``sft_loss``
      reads (``verl/workers/utils/losses.py``:35-41: ``loss_mask.values()``);
    * ``tu.get_tensordict`` with the trainer's ``meta_info`` (``sft_trainer.py``:343-374), then
      ``update_lr_scheduler`` and ``global_token_num`` (:375-379; ``_get_batch_seqlens``
      :272-292 with dp 1: the nested lengths);
    * the keys ``TrainingWorker.train_batch`` fills in from the configs where the batch lacks
      them (``verl/workers/engine_workers.py``:351-362).

    ``batch_num_tokens``, ``dp_size`` and ``num_micro_batch`` are the engine's own
    (``forward_backward_batch``, ``verl/workers/engine/megatron/transformer_impl.py``:840-848,
    932)."""
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    collated = SFTTensorCollator(DatasetPadMode.NO_PADDING)(samples)
    meta_info = {  # SFTTrainer.fit, with this engine's configs in place of the trainer's
        "use_remove_padding": model_config.use_remove_padding,
        "use_dynamic_bsz": engine_config.use_dynamic_bsz,
        "max_token_len_per_gpu": engine_config.max_token_len_per_gpu,
        "micro_batch_size_per_gpu": engine_config.micro_batch_size_per_gpu,
        "temperature": 1.0,
        "global_batch_size": global_batch_size,
        "pad_mode": DatasetPadMode.NO_PADDING,
        "pad_token_id": model_config.tokenizer.pad_token_id,
    }
    data = tu.get_tensordict(tensor_dict=collated, non_tensor_dict=meta_info)
    batch_seqlens = data["input_ids"].offsets().diff().tolist()
    # NonTensorData: otherwise the list is taken for a NonTensorStack (sft_trainer.py:376)
    tu.assign_non_tensor(data, update_lr_scheduler=True,
                         global_token_num=NonTensorData(batch_seqlens))
    defaults = {  # TrainingWorker.train_batch
        "use_remove_padding": model_config.get("use_remove_padding", False),
        "use_dynamic_bsz": engine_config.use_dynamic_bsz,
        "max_token_len_per_gpu": engine_config.max_token_len_per_gpu,
        "micro_batch_size_per_gpu": engine_config.micro_batch_size_per_gpu,
        "use_fused_kernels": engine_config.use_fused_kernels,
    }
    for key, value in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: value})
    return data


def engine_batch(engine, size: ModelSize, seed: int = 1):
    """``sft_batch`` of ``sft_samples`` for ``engine`` (its own model and engine configs), the
    whole batch one micro-batch (``micro_batch_size_per_gpu`` = ``size.batch``)."""
    return sft_batch(sft_samples(size, seed), engine.model_config, engine.engine_config,
                     global_batch_size=size.batch)


def sft_loss_function():
    """The loss verl's SFT trainer sets on its worker: ``partial(sft_loss, config=None)``
    (``verl/trainer/sft_trainer.py``:163)."""
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)
