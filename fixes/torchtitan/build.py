"""Building a torchtitan model the engine trains, on any device: the model spec with the
attention type honoured, torchtitan's meshes built for the engine's device, and the model's
``parallelize_fn`` without its FSDP step where FSDP has nothing to shard.
``fixes.torchtitan.engine.TorchtitanEngine`` uses them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import metadata

from fixes.torchtitan.config import ATTN_TYPES, TorchtitanEngineConfig

__all__ = ["build_model_spec", "lm_attn_types", "mesh_device_type", "parallelize_without_fsdp",
           "skip_fsdp",
           "torchtitan_version", "training_config"]


def build_model_spec(name: str, flavor: str, attn_type: str):
    """torchtitan's ``ModelSpec`` for (name, flavor) with ``attn_type`` honoured (verl #6182:
    the attention type was silently ignored when it was not passed to ``model_registry``).

    flex / flex_flash / varlen go to ``model_registry(flavor, attn_backend=attn_type)``.
    torchtitan 0.3.0 rejects "sdpa" for language models; it is built the way torchtitan's
    graph_trainer tests build it (``build_decoder_config_for_backend``): the flex config with
    every layer's inner attention swapped to ``ScaledDotProductAttention`` (causal only).
    """
    import importlib

    if attn_type not in ATTN_TYPES:
        raise ValueError(f"attn_type={attn_type!r} is not supported; allowed: {ATTN_TYPES}")
    if attn_type not in lm_attn_types():
        raise ValueError(
            f"torchtitan {torchtitan_version()} cannot build attn_type='sdpa' for its language "
            "models: their attention runs on flat (T, N, H) tokens and ScaledDotProductAttention "
            f"takes (B, L, N, H); allowed there: {lm_attn_types()}")
    module = importlib.import_module(f"torchtitan.models.{name}")
    backend = "flex" if attn_type == "sdpa" else attn_type
    try:
        spec = module.model_registry(flavor, attn_backend=backend)
    except KeyError:
        from fixes.torchtitan.flavor import flavor_shapes

        raise ValueError(
            f"torchtitan {name} has no flavor {flavor!r}; allowed: {list(flavor_shapes(name))}"
        ) from None
    except ValueError as exc:
        # e.g. flex_flash without a Hopper/Blackwell GPU: say so, never fall back silently.
        raise ValueError(f"torchtitan {name} cannot build attn_type={attn_type!r}: {exc}") from exc
    if attn_type == "sdpa":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def lm_attn_types() -> tuple[str, ...]:
    """The ``ATTN_TYPES`` the installed torchtitan builds for language models: all of them on
    0.3.0, whose inner attentions take (B, L, N, H) (``q_BLNH``); no "sdpa" where they take flat
    (T, N, H) tokens (``q_TNH``: torchtitan main), as ScaledDotProductAttention still takes
    (B, L, N, H) and, swapped in, fails in torchtitan's sharding (``local_map ...
    in_dst_shardings is missing entries for: ['q_BLNH', ...]``). torchtitan names each
    tensor's layout in its suffix; that name is what is read."""
    import inspect

    from torchtitan.models.common.attention import FlexAttention

    if "q_TNH" in inspect.signature(FlexAttention.forward).parameters:
        return tuple(a for a in ATTN_TYPES if a != "sdpa")
    return ATTN_TYPES


def training_config(training_cls, seq_len: int, **fields):
    """torchtitan's ``TrainingConfig`` for one sequence of ``seq_len`` tokens a microbatch, in
    the fields the installed torchtitan names: ``seq_len`` / ``local_batch_size`` (0.3.0), or
    ``max_context_length`` / ``num_tokens_per_microbatch_per_dp_rank`` (main since those
    replaced them). ``fields`` (max_norm, mixed precision) are the same in both. A torchtitan
    with neither pair is refused naming both, never built with a default length."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(training_cls)}
    if {"seq_len", "local_batch_size"} <= names:
        return training_cls(seq_len=seq_len, local_batch_size=1, **fields)
    if {"max_context_length", "num_tokens_per_microbatch_per_dp_rank"} <= names:
        return training_cls(max_context_length=seq_len,
                            num_tokens_per_microbatch_per_dp_rank=seq_len, **fields)
    raise ValueError(
        f"torchtitan {torchtitan_version()}: its TrainingConfig has neither seq_len / "
        "local_batch_size (torchtitan 0.3.0) nor max_context_length / "
        "num_tokens_per_microbatch_per_dp_rank (torchtitan main): the engine cannot size a "
        f"microbatch of {seq_len} tokens")


@contextlib.contextmanager
def mesh_device_type(device_type: str) -> Iterator[None]:
    """Build torchtitan meshes for ``device_type``. ``ParallelDims.build_mesh`` calls
    ``init_device_mesh(device_type, ...)`` with the module global it imported from
    ``torchtitan.tools.utils``, which falls back to "cuda" when no accelerator is present
    (tools/utils.py ``get_device_info``); FSDP then asks CUDA for the current device. The
    global is swapped for the duration of the call and put back."""
    from torchtitan.distributed import parallel_dims

    saved = parallel_dims.device_type
    parallel_dims.device_type = device_type
    try:
        yield
    finally:
        parallel_dims.device_type = saved


def torchtitan_version() -> str:
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return "?"


def skip_fsdp(cfg: TorchtitanEngineConfig, parallel_dims) -> bool:
    """True where FSDP has nothing to shard and would reject the model: spmd_types with TP > 1
    and no data-parallel degree. torchtitan's parallelize functions always call
    ``apply_fsdp_to_decoder``; under spmd_types the TP-parallelized parameters are plain
    tensors, and ``fully_shard(..., dp_mesh_dims=...)`` on torch < 2.14 rejects them ("all
    parameters must be DTensors on the full SPMD mesh"). With dp degree 1 the FSDP
    step would only install a MixedPrecisionPolicy, so the engine leaves it out."""
    dp_degree = parallel_dims.dp_replicate * parallel_dims.dp_shard * parallel_dims.cp
    return cfg.spmd_backend == "spmd_types" and cfg.tp > 1 and dp_degree == 1


def parallelize_without_fsdp(spec, model, parallel_dims, tc):
    """The model's ``parallelize_fn`` minus its FSDP step (see ``skip_fsdp``). qwen3's takes
    ``skip_dp=True`` for exactly this; llama3's has no such switch, so its steps before FSDP are
    called one by one, in its order: validate (0.3.0) + TP (``model.parallelize``), AC,
    compile."""
    import inspect

    if "skip_dp" in inspect.signature(spec.parallelize_fn).parameters:
        return spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=tc.training,
            parallelism=tc.parallelism,
            compile_config=tc.compile,
            ac_config=tc.activation_checkpoint,
            dump_folder=tc.dump_folder,
            skip_dp=True,
        )
    from torchtitan.distributed.compile import apply_compile

    try:  # 0.3.0's parallelize_llama validates first; main's has no such step: the module
        # went with the full_dtensor backend (torchtitan #4217)
        from torchtitan.distributed.full_dtensor import validate_config
    except ModuleNotFoundError:
        validate_config = None
    if validate_config is not None:
        validate_config(parallel_dims, model)
    model.parallelize(parallel_dims)
    if tc.activation_checkpoint is not None:
        tc.activation_checkpoint.build(dump_folder=tc.dump_folder).apply(model)
    if tc.compile.enable and "model" in tc.compile.components:
        apply_compile(model, compile_config=tc.compile, parallel_dims=parallel_dims)
    return model
