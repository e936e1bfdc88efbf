"""verl's own Megatron engine (``MegatronEngineWithLMHead``, verl 0.8.0 / 0.9.1), built through
verl's public config classes from a tiny Hugging Face model directory written here (config,
a word-level tokenizer and random weights; nothing downloaded), with full recompute on as verl
users configure it (``override_transformer_config``: ``recompute_granularity="full"``,
``recompute_method="uniform"``). Run as ``python -m repro.verl_engine SCENARIO --kind K`` in a
child process (tests/test_verl_engine.py); each scenario prints one ``RESULT {json}`` line.
Whether the verl plugin loads is decided by the child's environment before ``import verl``, as
a user decides it (repro/verl_plugin.py).

Kinds: ``dense`` (``Qwen2ForCausalLM``) and ``moe`` (``Qwen3MoeForCausalLM``). The bridge is
verl's ``vanilla_mbridge=True`` (mbridge), on megatron-core's local spec through
repro/harness/mbridge_local_spec.py (no Transformer Engine on either machine). The settings
below that a plain verl config would not carry say why in place.

Scenarios:

* ``init`` (any device): the engine's ``__init__`` (model-parallel init, seeds, verl's reclaim
  when CUDA is available), what ``installed_reclaim()`` says then, then ``initialize()`` (the
  bridge's config, the model, weights, optimizer). On a CPU-only machine ``initialize()``
  stops at the first CUDA call it makes; the scenario reports that frame.
* ``train`` (CUDA): ``init``, then ``--steps`` training steps as verl's ``TrainingWorker``
  runs them (the engine's own ``train_batch``: zero grad, megatron's forward/backward
  schedule, optimizer step; then the LR scheduler step) on one fixed batch, built as verl's SFT
  trainer builds it (``engine_batch``: nested, no padding, with the trainer's and the
  worker's meta) and verl's ``sft_loss``: per step the loss, grad norm, a digest of every
  parameter's main grad and of the parameters after the step, memory and time. ``--reclaim
  none`` puts megatron-core's own backward back after the engine's init (the no-reclaim
  reference).
* ``loss`` (CPU): ``init``, then the engine's own ``forward_backward_batch`` on the batch
  ``train`` uses, with verl's ``sft_loss``, a stand-in model (logits from one table) and a
  stand-in for megatron's schedule (both need CUDA): the batch layout and verl's loss path as
  released, checked against the loss computed by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from repro.harness.verl_engine_inputs import (
    KINDS,
    SIZES,
    ModelSize,
    engine_batch,
    sft_loss_function,
    sft_samples,
    write_tiny_model,
)

SCENARIOS = ("init", "train", "loss")


def _report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


# --- verl's configs -----------------------------------------------------------------------------


def transformer_overrides(kind: str, device: str) -> dict:
    """``override_transformer_config`` of the engine: full recompute as a verl user sets it,
    plus what megatron-core's local spec needs where mbridge's bridges assume TE."""
    over = {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1,
            # the local spec's attention (repro/harness/mbridge_local_spec.py); verl's default
            # "flash" names TE's
            "attention_backend": "local",
            # fused kernels that Apex / TE build (scaled_masked_softmax_cuda,
            # fused_weight_gradient_mlp_cuda, ...): neither is installed (H200: ModuleNotFoundError
            # 'scaled_masked_softmax_cuda' in the first train_batch); megatron's torch paths
            "masked_softmax_fusion": False, "gradient_accumulation_fusion": False,
            "bias_activation_fusion": False, "bias_dropout_fusion": False,
            "apply_rope_fusion": False, "persist_layer_norm": False}
    if kind == "moe":
        # mbridge's Qwen3-MoE bridge sets both for TE: grouped GEMM (TE's, or the grouped_gemm
        # package's) and persist_layer_norm (Apex/TE; megatron's torch norm asserts it is off)
        over.update(moe_grouped_gemm=False, persist_layer_norm=False)
    if device == "cpu":
        # megatron's layers allocate on torch.cuda.current_device() unless told otherwise
        over["use_cpu_initialization"] = True
    return over


def engine_configs(path: Path, kind: str, device: str, size: ModelSize):
    """(HFModelConfig, McoreEngineConfig, McoreOptimizerConfig, CheckpointConfig)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    # use_remove_padding as the engine's (below): the SFT trainer's meta and TrainingWorker's
    # default read the model config's (verl/trainer/sft_trainer.py:344,
    # verl/workers/engine_workers.py:353); the Megatron engine itself reads the engine config's
    model = HFModelConfig(path=str(path), use_remove_padding=False)
    engine = McoreEngineConfig(
        vanilla_mbridge=True,  # mbridge: Megatron-Bridge requires Transformer Engine
        dtype="bfloat16",  # McoreEngineConfig takes bfloat16 or float16 only
        # bshd: verl's thd (packed) path needs TE's attention (megatron's local
        # DotProductAttention asserts packed_seq_params is None)
        use_remove_padding=False,
        use_dynamic_bsz=False, micro_batch_size_per_gpu=size.batch,
        override_transformer_config=transformer_overrides(kind, device),
    )
    # total_training_steps: verl's scheduler decays over it and megatron's asserts it is > 0
    # (OptimizerParamScheduler: lr_decay_steps > 0; the default -1 failed on the H200)
    optimizer = McoreOptimizerConfig(lr=1e-4, total_training_steps=10, lr_decay_style="constant")
    return model, engine, optimizer, CheckpointConfig()


# --- the engine ---------------------------------------------------------------------------------


def init_process_group(device: str) -> None:
    """World size 1, as one verl worker of one GPU: gloo on CPU, NCCL on CUDA."""
    from repro.harness.isolated import free_loopback_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_loopback_port()))
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0,
                                         world_size=1)


def plugin_state() -> dict | None:
    plugin = sys.modules.get("fixes.verl")
    state = plugin.status() if plugin is not None else None
    return None if state is None else {"version": state.version, "armed": list(state.armed)}


def installed_reclaim() -> str | None:
    from fixes.megatron.reclaim import installed_reclaim as installed

    return installed()


def _where(filename: str) -> str:
    """``filename`` from its top-level package on (below site-packages, or this repository)."""
    parts = Path(filename).parts
    for anchor in ("site-packages", Path(__file__).resolve().parent.parent.name):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor):])
    return filename


def engine_reclaim_function() -> str:
    """Where the function verl's engine calls (``verl.models.mcore.patch.apply_patch_megatron_
    recomputation_backward``) is defined: the plugin's replacement or verl's own."""
    from verl.models.mcore import patch

    return _where(patch.apply_patch_megatron_recomputation_backward.__code__.co_filename)


def build_engine(path: Path, kind: str, device: str, size: ModelSize):
    """``MegatronEngineWithLMHead(...)``: its ``__init__`` only, as verl's TrainingWorker builds
    it (``initialize()`` is a separate step there too)."""
    from verl.workers.engine.megatron import MegatronEngineWithLMHead

    from repro.harness.mbridge_local_spec import use_local_spec_in_mbridge

    use_local_spec_in_mbridge()
    return MegatronEngineWithLMHead(*engine_configs(path, kind, device, size))


def _frame_outside_torch(exc: BaseException) -> dict:
    """The innermost traceback frame not in torch itself (the code that asked for CUDA), and the
    innermost frame of verl's own code on the way there."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename]
    verl_frames = [f for f in frames if _where(f.filename).startswith("verl/")]
    frame, via = frames[-1], verl_frames[-1] if verl_frames else None
    return {"error": f"{type(exc).__name__}: {exc}", "file": _where(frame.filename),
            "line": frame.lineno, "function": frame.name,
            "verl_frame": None if via is None else f"{_where(via.filename)}:{via.lineno}"}


def _recompute_config(engine) -> dict:
    tf = engine.tf_config
    return {"recompute_granularity": tf.recompute_granularity,
            "recompute_method": tf.recompute_method, "num_moe_experts": tf.num_moe_experts,
            "num_layers": tf.num_layers}


class _NoCuda:
    """Catches, on a machine without CUDA only, the error torch raises where code asks for it
    ("Torch not compiled with CUDA enabled": AssertionError; "torch.cuda.Stream requires CUDA
    support": RuntimeError) and keeps the frame that asked. Elsewhere it catches nothing."""

    def __init__(self):
        self.stop: dict | None = None

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or torch.cuda.is_available():
            return False
        if not isinstance(exc, (AssertionError, RuntimeError)):
            return False
        self.stop = _frame_outside_torch(exc)
        return True


def init_scenario(kind: str, device: str, size: ModelSize, root: Path):
    """(what the init showed, the engine or None where its ``__init__`` stopped)."""
    import verl

    path = write_tiny_model(root, kind, size)
    init_process_group(device)
    got = {"verl": verl.__version__, "plugin": plugin_state(), "cuda": torch.cuda.is_available(),
           "engine_calls": engine_reclaim_function()}
    engine = None
    with _NoCuda() as at_init:
        engine = build_engine(path, kind, device, size)
    got["init_stop"] = at_init.stop
    got["installed_after_init"] = installed_reclaim()
    got["initialize_stop"] = got["recompute"] = None
    if engine is not None:
        with _NoCuda() as at_initialize:
            engine.initialize()
        got["initialize_stop"] = at_initialize.stop
        got["recompute"] = _recompute_config(engine)  # the bridge's TransformerConfig
    got["installed_after_initialize"] = installed_reclaim()
    return got, engine


# --- a training step ----------------------------------------------------------------------------


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_step(engine, data) -> dict:
    """One step as ``TrainingWorker.train_batch`` runs it (``verl/workers/engine_workers.py``:
    364-376): ``engine.train_batch`` (zero grad, forward/backward, optimizer step) inside
    ``engine.train_mode()``, then ``lr_scheduler_step()`` (the batch asks for it:
    ``update_lr_scheduler``). Measured: loss, grad norm, digests of the main grads (and how many
    of their elements are nonzero) and of the updated parameters, bytes allocated before / after
    / at peak, seconds of ``train_batch``."""
    from verl.utils import tensordict_utils as tu

    params = [p for chunk in engine.module for p in chunk.parameters()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with engine.train_mode():
        out = engine.train_batch(data.clone(), loss_function=sft_loss_function())
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # inside the context: leaving it zeroes the grads (zero_grad_on_exit, verl's default;
        # a digest taken after it read zeros, equal in every run and step)
        grads = [g for p in params if (g := getattr(p, "main_grad", None)) is not None]
        grads_digest = _digest(grads)
        grads_nonzero = sum(int(torch.count_nonzero(g)) for g in grads)
    if tu.get(data, key="update_lr_scheduler", default=False):
        engine.lr_scheduler_step()
    return {"loss": [float(x) for x in out["loss"]], "grad_norm": float(out["metrics"]["grad_norm"]),
            "grads": grads_digest, "grads_nonzero": grads_nonzero,
            "params": _digest(params), "before_bytes": before,
            "after_bytes": torch.cuda.memory_allocated(),
            "peak_bytes": torch.cuda.max_memory_allocated(), "seconds": seconds}


def _checkpoint_inputs_probe():
    """Counts, per checkpointed call, the requires-grad inputs that are views into a larger
    storage (the crash-2 shape: a chunk view of a tensor something else keeps). Wraps
    megatron-core's ``CheckpointFunction.forward`` only to read its inputs."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    seen = {"calls": 0, "grad_inputs": 0, "views": 0}
    forward = CheckpointFunction.forward

    def counting_forward(ctx, run_function, distribute_saved_activations, *args):
        seen["calls"] += 1
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                seen["grad_inputs"] += 1
                whole = a.untyped_storage().nbytes()
                seen["views"] += int(whole != a.numel() * a.element_size())
        return forward(ctx, run_function, distribute_saved_activations, *args)

    CheckpointFunction.forward = staticmethod(counting_forward)
    return seen


def train_scenario(kind: str, size: ModelSize, root: Path, steps: int, reclaim: str) -> dict:
    # Runs are compared bit for bit across processes: deterministic kernels where torch has
    # them (the MoE dispatcher's scatter-adds would otherwise differ run to run); an op without
    # one warns, and the warning names it in the run's log.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    got, engine = init_scenario(kind, "cuda", size, root)
    # megatron-core 0.16.1's MoE router reads moe_utils.te_general_gemm, bound only where
    # Transformer Engine imports (H200 without TE: NameError in the first train_batch); bound to
    # None, the value of its own torch fallback (fixes/testing/megatron_cpu.py, part 5; a no-op
    # where it is bound). No config field avoids that read.
    from fixes.testing.megatron_cpu import bind_missing_te_general_gemm

    got["te_general_gemm_bound"] = bind_missing_te_general_gemm()
    if reclaim == "none":
        from megatron.core.tensor_parallel.random import CheckpointFunction

        from repro.reclaims import install_reclaim

        install_reclaim("none", CheckpointFunction)  # megatron-core's own backward again
    got["installed_for_steps"] = installed_reclaim()
    data = engine_batch(engine, size)
    probe = _checkpoint_inputs_probe()
    got["steps"] = [train_step(engine, data) for _ in range(steps)]
    got["checkpoint_inputs"] = probe
    got["gpu"] = torch.cuda.get_device_name()
    return got


# --- CPU: verl's batch through the engine's own loss path -----------------------------------------


class _StandInLM(torch.nn.Module):
    """The model on CPU: logits ``table[input_ids]`` (one trainable ``[vocab, vocab]`` table),
    in the shape and dtype megatron's GPT model hands verl's engine (``[b, s, vocab]`` fp32,
    bshd). Only the batch layout and verl's loss path are under test here: no layer, no
    recompute, no reclaim."""

    def __init__(self, config, vocab: int, seed: int = 2):
        super().__init__()
        # what verl's forward reads of megatron's GPTModel: its config (fp8,
        # experimental_attention_variant) and the pipeline stage (one stage: first and last)
        self.config = config
        self.pre_process = self.post_process = True
        self.table = torch.nn.Parameter(
            torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.table[input_ids]


def _one_microbatch_at_a_time(*, forward_step_func, data_iterator, model, num_microbatches,
                              forward_only, **kwargs):
    """Stands in for megatron's ``forward_backward_no_pipelining`` on CPU (it allocates its
    token count on CUDA, ``pipeline_parallel/schedules.py``:596): per micro-batch the engine's
    forward step, its loss function on the output, ``loss / num_microbatches`` backward (as
    ``forward_step_calc_loss`` / ``backward_step`` do), the loss functions' outputs
    collected."""
    (model,) = model if isinstance(model, list) else [model]
    (data_iterator,) = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    store = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model)
        loss, reduced = loss_func(output)
        if not forward_only:
            (loss / num_microbatches).backward()
        store.append(reduced)
    return store


def _reference_sft_loss(samples: list[dict], table: torch.Tensor) -> float:
    """sft_loss by hand from the samples: minus the mean log-probability of each response token
    given the token before it."""
    total, tokens = 0.0, 0
    for sample in samples:
        ids, mask = sample["input_ids"], sample["loss_mask"]
        logp = torch.log_softmax(table[ids[:-1]].double(), dim=-1)
        picked = logp.gather(-1, ids[1:, None])[:, 0]
        total += float((picked * mask[1:]).sum())
        tokens += int(mask.sum())
    return -total / tokens


def loss_scenario(kind: str, size: ModelSize, root: Path) -> dict:
    """CPU: the engine built as far as CPU allows (``init``), then its own
    ``forward_backward_batch`` on the batch ``train`` hands it (``engine_batch``), with
    verl's loss (``sft_loss_function``), verl's micro-batching, forward step (bshd padding and
    unpadding, label roll, temperature, log-probs from logits) and loss postprocessing as
    released; stand-ins for the model (``_StandInLM``) and megatron's schedule only. Reports the
    loss against ``_reference_sft_loss`` and the layout verl saw."""
    got, engine = init_scenario(kind, "cpu", size, root)
    if engine is None:  # verl 0.8.0: its __init__ stops on CPU (got["init_stop"])
        return got
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl

    from fixes.testing.megatron_cpu import install_megatron_cpu_moe_shim

    # verl's get_device_id() is torch.cuda.current_device(): on a CPU-only build it names the
    # CPU through the project's shim
    install_megatron_cpu_moe_shim()
    transformer_impl.get_forward_backward_func = lambda: _one_microbatch_at_a_time
    model = _StandInLM(engine.tf_config, size.vocab)
    engine.module = [model]
    samples = sft_samples(size)
    data = engine_batch(engine, size)
    layout = {key: bool(data[key].is_nested) for key in ("input_ids", "position_ids",
                                                          "loss_mask")}
    given = data.clone()  # as train_step hands it over (the engine adds its keys to it)
    out = engine.forward_backward_batch(given, loss_function=sft_loss_function(),
                                        forward_only=False)
    got.update(
        layout=layout, loss=[float(x) for x in out["loss"]],
        update_lr_scheduler=tu.get(data, key="update_lr_scheduler", default=False),
        reference_loss=_reference_sft_loss(samples, model.table.detach()),
        batch_num_tokens=tu.get(given, key="batch_num_tokens"),
        loss_mask_tokens=int(sum(int(s["loss_mask"].sum()) for s in samples)),
        num_micro_batch=tu.get(given, key="num_micro_batch"),
        log_probs_nested=bool(out["model_output"]["log_probs"].is_nested),
        log_probs_lengths=out["model_output"]["log_probs"].offsets().diff().tolist(),
        sample_lengths=[len(s["input_ids"]) for s in samples],
        grad_abs_sum=float(model.table.grad.abs().sum()) if model.table.grad is not None else None)
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.verl_engine")
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--root", type=Path, required=True, help="where the model dir goes")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--reclaim", choices=("installed", "none"), default="installed")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    if args.scenario == "init":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        _report(size=asdict(size), **init_scenario(args.kind, device, size, args.root)[0])
    elif args.scenario == "loss":
        _report(size=asdict(size), **loss_scenario(args.kind, size, args.root))
    else:
        _report(size=asdict(size), reclaim=args.reclaim,
                **train_scenario(args.kind, size, args.root, args.steps, args.reclaim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
