"""``TorchtitanEngineConfig``: what a TorchtitanEngine is built from, validated in one place.

Seeds: verl #6916 (spmd_backend, activation_checkpoint, ParamGroupConfig optimizer) and
verl #6231 (attn_type reaching ``model_registry(flavor, attn_backend=...)``, loss config).
verl validates with ``assert`` and a hard-coded ``spmd_backend`` list ``default |
full_dtensor | spmd_types`` that torchtitan 0.3.0 does not accept (its values are
``partial_dtensor | full_dtensor | spmd_types``). Here every invalid value is a ``ValueError``
naming the allowed ones, and the values torchtitan decides (spmd backends, optimizer names)
are read from the installed torchtitan instead of being copied.

torchtitan is imported lazily (inside functions), so ``import fixes.torchtitan`` needs only
torch and spmd_types.
"""

from __future__ import annotations

import functools
import re
import typing
from dataclasses import dataclass, field

__all__ = [
    "AC_MODES",
    "ATTN_TYPES",
    "LOSS_NAMES",
    "OptimizerSettings",
    "ParamGroupSettings",
    "TorchtitanEngineConfig",
    "allowed_spmd_backends",
]

# The engine's attention vocabulary. flex / flex_flash / varlen go to torchtitan's
# ``model_registry(flavor, attn_backend=...)`` unchanged. torchtitan 0.3.0 rejects "sdpa" for
# language models (``get_attention_config``: "sdpa is no longer supported"); the engine builds
# it the way torchtitan's own graph_trainer tests do (flex config, inner attention swapped to
# ScaledDotProductAttention). It is causal-only (no document masks) and the one backend with a
# CPU backward: FlexAttention raises "does not support backward on CPU", varlen has no CPU
# kernel (torch 2.13).
ATTN_TYPES = ("flex", "flex_flash", "varlen", "sdpa")

# activation_checkpoint -> torchtitan AC config class name (verl #6916's mapping); "none" -> None.
AC_MODES = ("selective", "full", "none")

# The losses the engine builds (torchtitan.components.loss); the Trainer needs an explicit
# loss config since torchtitan dropped the implicit default (verl #6231).
LOSS_NAMES = ("cross_entropy",)

MIXED_PRECISION_DTYPES = ("float32", "bfloat16")


@functools.cache
def allowed_spmd_backends() -> tuple[str, ...]:
    """The ``spmd_backend`` values the installed torchtitan accepts, read from the ``Literal``
    annotation of ``torchtitan.config.ParallelismConfig.spmd_backend`` (0.3.0:
    partial_dtensor, full_dtensor, spmd_types)."""
    from torchtitan.config import ParallelismConfig

    hint = typing.get_type_hints(ParallelismConfig)["spmd_backend"]
    values = typing.get_args(hint)
    if typing.get_origin(hint) is not typing.Literal or not values:
        raise RuntimeError(
            f"cannot read the spmd_backend values from torchtitan: annotation is {hint!r}"
        )
    return tuple(values)


def _check_optimizer_name(name: str) -> None:
    """torchtitan resolves optimizer names in a private table inside
    ``OptimizersContainer._resolve_optimizer_factory``; ask it rather than copy the table."""
    from torchtitan.components.optimizer import OptimizersContainer

    try:
        OptimizersContainer._resolve_optimizer_factory(name)
    except NotImplementedError as exc:
        raise ValueError(
            f"optimizer name {name!r} is not built by the installed torchtitan ({exc}); "
            "allowed: the names OptimizersContainer._resolve_optimizer_factory knows "
            "(0.3.0: Adam, AdamW, DistMuon)"
        ) from None


def _one_of(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def _check_lr(what: str, lr) -> None:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ValueError(f"{what} must be a number > 0, got {lr!r}")


def _check_weight_decay(what: str, wd) -> None:
    if not isinstance(wd, (int, float)) or isinstance(wd, bool) or wd < 0:
        raise ValueError(f"{what} must be a number >= 0, got {wd!r}")


@dataclass(kw_only=True, frozen=True, slots=True)
class ParamGroupSettings:
    """One optimizer parameter group: parameters whose fully qualified name matches
    ``pattern`` (``re.search``) get these overrides of the optimizer defaults. Groups are
    matched in order, first match wins (torchtitan's ParamGroupConfig rule); parameters no
    group matches use the defaults."""

    pattern: str
    lr: float | None = None
    weight_decay: float | None = None


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerSettings:
    """Optimizer defaults; validated by TorchtitanEngineConfig.__post_init__."""

    name: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    # "foreach" / "for-loop" run on CPU; torchtitan's default "fused" is CUDA-only.
    implementation: str = "foreach"
    param_groups: tuple[ParamGroupSettings, ...] = ()


_OPTIMIZER_IMPLEMENTATIONS = ("for-loop", "foreach", "fused", "fused_opt_states_bf16")


# torch < 2.14: fully_shard(..., dp_mesh_dims=...) rejects the plain tensors spmd_types leaves
# ("all parameters must be DTensors on the full SPMD mesh"); torch 2.14 accepts them.
FSDP_WITH_SPMD_TYPES_TORCH = (2, 14)


def check_fsdp_supported(spmd_backend: str, dp_shard: int, torch_version: str | None = None) -> None:
    """ValueError when FSDP (dp_shard > 1) is asked for under spmd_types on a torch that rejects
    it. ``torch_version`` defaults to the running torch."""
    if spmd_backend != "spmd_types" or dp_shard in (-1, 1):
        return
    version = torch_version or _torch_version()
    if release_tuple(version) < FSDP_WITH_SPMD_TYPES_TORCH:
        need = ".".join(map(str, FSDP_WITH_SPMD_TYPES_TORCH))
        raise ValueError(
            f"dp_shard={dp_shard} (FSDP) with spmd_backend='spmd_types' needs torch >= {need}; "
            f"torch {version} rejects it. Use dp_shard=1, or another spmd_backend: "
            f"{sorted(set(allowed_spmd_backends()) - {'spmd_types'})}"
        )


def _torch_version() -> str:
    import torch

    return torch.__version__


def release_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.13.0+cpu"."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


@dataclass(kw_only=True, slots=True)
class TorchtitanEngineConfig:
    """How a ``TorchtitanEngine`` builds and trains a torchtitan model.

    Parallel sizes follow torchtitan's ParallelismConfig (``dp_shard=-1``: whatever the world
    size leaves). Construct it and every field is checked; an invalid value raises
    ``ValueError`` naming the allowed values.
    """

    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # torchtitan's enable_sequence_parallel (on by default there): TP shards activations on
    # the sequence between blocks.
    sequence_parallel: bool = True
    attn_type: str = "flex"
    spmd_backend: str = "spmd_types"
    activation_checkpoint: str = "selective"
    use_torch_compile: bool = False
    mixed_precision_param: str = "float32"
    max_norm: float = 1.0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    loss: str = "cross_entropy"
    seed: int = 0

    def __post_init__(self):
        for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if (
            not isinstance(self.dp_shard, int)
            or isinstance(self.dp_shard, bool)
            or not (self.dp_shard == -1 or self.dp_shard >= 1)
        ):
            raise ValueError(f"dp_shard must be -1 (the rest of the world) or an int >= 1, got {self.dp_shard!r}")
        # The engine drives one model part; torchtitan's pipeline schedules own the step
        # (and the loss) under PP, which forward_backward_batch does not wrap.
        _one_of("pp", self.pp, (1,))
        # Context parallelism shards the sequence inside torchtitan's train step
        # (``context_parallel`` around forward and backward with the buffers to shard), which
        # this engine does not drive: accepting cp > 1 would train on unsharded sequences.
        _one_of("cp", self.cp, (1,))
        check_fsdp_supported(self.spmd_backend, self.dp_shard)
        _one_of("attn_type", self.attn_type, ATTN_TYPES)
        _one_of("spmd_backend", self.spmd_backend, allowed_spmd_backends())
        _one_of("activation_checkpoint", self.activation_checkpoint, AC_MODES)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if not isinstance(self.use_torch_compile, bool):
            raise ValueError(f"use_torch_compile must be True or False, got {self.use_torch_compile!r}")
        _one_of("mixed_precision_param", self.mixed_precision_param, MIXED_PRECISION_DTYPES)
        if not isinstance(self.max_norm, (int, float)) or isinstance(self.max_norm, bool) or not self.max_norm > 0:
            raise ValueError(f"max_norm must be a number > 0, got {self.max_norm!r}")
        _one_of("loss", self.loss, LOSS_NAMES)
        self._check_optimizer(self.optimizer)

    @staticmethod
    def _check_optimizer(opt) -> None:
        if not isinstance(opt, OptimizerSettings):
            raise ValueError(f"optimizer must be an OptimizerSettings, got {type(opt).__name__}")
        _check_optimizer_name(opt.name)
        _check_lr("optimizer.lr", opt.lr)
        _check_weight_decay("optimizer.weight_decay", opt.weight_decay)
        betas = opt.betas
        if not (
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {betas!r}")
        if not isinstance(opt.eps, (int, float)) or not opt.eps > 0:
            raise ValueError(f"optimizer.eps must be a number > 0, got {opt.eps!r}")
        _one_of("optimizer.implementation", opt.implementation, _OPTIMIZER_IMPLEMENTATIONS)
        for i, group in enumerate(opt.param_groups):
            if not isinstance(group, ParamGroupSettings):
                raise ValueError(
                    f"optimizer.param_groups[{i}] must be a ParamGroupSettings, got {type(group).__name__}"
                )
            try:
                re.compile(group.pattern)
            except (re.error, TypeError) as exc:
                raise ValueError(
                    f"optimizer.param_groups[{i}].pattern {group.pattern!r} is not a valid regex: {exc}"
                ) from None
            if group.lr is not None:
                _check_lr(f"optimizer.param_groups[{i}].lr", group.lr)
            if group.weight_decay is not None:
                _check_weight_decay(f"optimizer.param_groups[{i}].weight_decay", group.weight_decay)

    def ac_config(self):
        """torchtitan's AC config for ``activation_checkpoint`` (verl #6916's mapping):
        selective -> SelectiveAC.Config(), full -> FullAC.Config(), none -> None."""
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        return {"selective": SelectiveAC.Config, "full": FullAC.Config, "none": lambda: None}[
            self.activation_checkpoint
        ]()

    def parallelism_config(self):
        """torchtitan's ParallelismConfig for these sizes and backend."""
        from torchtitan.config import ParallelismConfig

        return ParallelismConfig(
            data_parallel_replicate_degree=self.dp_replicate,
            data_parallel_shard_degree=self.dp_shard,
            tensor_parallel_degree=self.tp,
            pipeline_parallel_degree=self.pp,
            context_parallel_degree=self.cp,
            expert_parallel_degree=self.ep,
            enable_sequence_parallel=self.sequence_parallel,
            spmd_backend=self.spmd_backend,
        )

    def optimizer_config(self, param_names=None):
        """``OptimizersContainer.Config(param_groups=[ParamGroupConfig(...)])``: one
        ParamGroupConfig per configured group, then a catch-all ``.*`` with the defaults
        (first match wins). Given the model's ``param_names``, the catch-all is left out when
        the configured groups already claim every parameter: torchtitan rejects a group that
        matches nothing."""
        from torchtitan.components.optimizer import OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        opt = self.optimizer

        def kwargs(lr, weight_decay):
            return {
                "lr": lr,
                "betas": (opt.betas[0], opt.betas[1]),
                "eps": opt.eps,
                "weight_decay": weight_decay,
            }

        groups = [
            ParamGroupConfig(
                pattern=g.pattern,
                optimizer_name=opt.name,
                optimizer_kwargs=kwargs(
                    opt.lr if g.lr is None else g.lr,
                    opt.weight_decay if g.weight_decay is None else g.weight_decay,
                ),
            )
            for g in opt.param_groups
        ]
        claimed_all = param_names is not None and all(
            any(re.search(g.pattern, n) for g in opt.param_groups) for n in param_names
        )
        if not claimed_all:
            defaults = kwargs(opt.lr, opt.weight_decay)
            groups.append(
                ParamGroupConfig(pattern=r".*", optimizer_name=opt.name, optimizer_kwargs=defaults)
            )
        return OptimizersContainer.Config(param_groups=groups, implementation=opt.implementation)

    def loss_config(self, global_vocab_size: int | None = None):
        """The loss config torchtitan's Trainer requires (verl #6231): CrossEntropyLoss, with
        the full vocabulary size that the spmd_types loss-parallel path needs at TP > 1 (as
        torchtitan's config_registry sets it: ``decoder_vocab_size(model_spec)``)."""
        from torchtitan.components.loss import CrossEntropyLoss

        return {"cross_entropy": CrossEntropyLoss.Config}[self.loss](
            global_vocab_size=global_vocab_size
        )
