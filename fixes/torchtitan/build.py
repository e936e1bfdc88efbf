"""Building a torchtitan model the engine trains, on any device: the model spec with the
attention type honoured, torchtitan's meshes built for the engine's device, and the model's
``parallelize_fn`` without its FSDP step where FSDP has nothing to shard.
``fixes.torchtitan.engine.TorchtitanEngine`` uses them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import metadata

from fixes.torchtitan.config import ATTN_TYPES, TorchtitanEngineConfig

__all__ = ["build_model_spec", "mesh_device_type", "parallelize_without_fsdp", "skip_fsdp",
           "torchtitan_version"]


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
    called one by one, in its order: validate + TP (``model.parallelize``), AC, compile."""
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
    from torchtitan.distributed.full_dtensor import validate_config

    validate_config(parallel_dims, model)
    model.parallelize(parallel_dims)
    if tc.activation_checkpoint is not None:
        tc.activation_checkpoint.build(dump_folder=tc.dump_folder).apply(model)
    if tc.compile.enable and "model" in tc.compile.components:
        apply_compile(model, compile_config=tc.compile, parallel_dims=parallel_dims)
    return model
