"""TorchtitanEngineConfig: every invalid value is a ValueError naming the allowed values, the
values torchtitan decides are read from the installed torchtitan, and the torchtitan configs
it produces carry what was asked (AC class, ParamGroupConfig per group, loss)."""

from __future__ import annotations

import typing

import pytest

from repro.harness.optional import require

pytestmark = pytest.mark.cpu

# the config reads spmd backends / optimizer names from torchtitan (config + components only)
require("torchtitan.components.optimizer", "torchtitan.config")

from fixes.torchtitan.config import (  # noqa: E402
    AC_MODES,
    ATTN_TYPES,
    OptimizerSettings,
    ParamGroupSettings,
    TorchtitanEngineConfig,
    allowed_spmd_backends,
)


def test_spmd_backends_are_the_installed_torchtitans():
    from torchtitan.config import ParallelismConfig

    hint = typing.get_type_hints(ParallelismConfig)["spmd_backend"]
    assert allowed_spmd_backends() == typing.get_args(hint)
    # verl #6916 validated against "default", which torchtitan 0.3.0 does not know
    assert "default" not in allowed_spmd_backends()


@pytest.mark.parametrize("backend", allowed_spmd_backends())
def test_every_torchtitan_spmd_backend_is_accepted_and_reaches_parallelism(backend):
    cfg = TorchtitanEngineConfig(spmd_backend=backend)
    assert cfg.parallelism_config().spmd_backend == backend


@pytest.mark.parametrize(
    "field,value,allowed_fragment",
    [
        ("attn_type", "flash", ATTN_TYPES),
        ("attn_type", "FLEX", ATTN_TYPES),
        ("spmd_backend", "default", None),
        ("spmd_backend", "dtensor", None),
        ("activation_checkpoint", "selective_op", AC_MODES),
        ("activation_checkpoint", None, AC_MODES),
        ("mixed_precision_param", "float16", ("float32", "bfloat16")),
        ("loss", "mse", ("cross_entropy",)),
        ("pp", 2, (1,)),
    ],
)
def test_invalid_choice_names_the_allowed_values(field, value, allowed_fragment):
    with pytest.raises(ValueError) as err:
        TorchtitanEngineConfig(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value) in msg
    for allowed in allowed_fragment or allowed_spmd_backends():
        assert repr(allowed) in msg


@pytest.mark.parametrize("field", ["dp_replicate", "tp", "cp", "ep"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_invalid_parallel_size(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1"):
        TorchtitanEngineConfig(**{field: value})


@pytest.mark.parametrize("value", [0, -2, 2.0, False])
def test_invalid_dp_shard(value):
    with pytest.raises(ValueError, match="dp_shard must be -1"):
        TorchtitanEngineConfig(dp_shard=value)


@pytest.mark.parametrize("field", ["use_torch_compile", "sequence_parallel"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_invalid_flag(field, value):
    with pytest.raises(ValueError, match=f"{field} must be True or False"):
        TorchtitanEngineConfig(**{field: value})


@pytest.mark.parametrize("value", [0, -1.0, "1"])
def test_invalid_max_norm(value):
    with pytest.raises(ValueError, match="max_norm"):
        TorchtitanEngineConfig(max_norm=value)


@pytest.mark.parametrize(
    "settings,fragment",
    [
        (OptimizerSettings(name="Lion"), "optimizer name 'Lion'"),
        (OptimizerSettings(lr=0), "optimizer.lr"),
        (OptimizerSettings(lr=-1e-3), "optimizer.lr"),
        (OptimizerSettings(weight_decay=-0.1), "optimizer.weight_decay"),
        (OptimizerSettings(betas=(0.9,)), "optimizer.betas"),
        (OptimizerSettings(betas=(0.9, 1.0)), "optimizer.betas"),
        (OptimizerSettings(eps=0), "optimizer.eps"),
        (OptimizerSettings(implementation="fast"), "optimizer.implementation"),
        (OptimizerSettings(param_groups=("norm",)), "param_groups[0] must be a ParamGroupSettings"),
        (OptimizerSettings(param_groups=(ParamGroupSettings(pattern="("),)), "not a valid regex"),
        (OptimizerSettings(param_groups=(ParamGroupSettings(pattern="x", lr=0),)), "param_groups[0].lr"),
        (
            OptimizerSettings(param_groups=(ParamGroupSettings(pattern="x", weight_decay=-1),)),
            "param_groups[0].weight_decay",
        ),
        ({"name": "AdamW"}, "must be an OptimizerSettings"),
    ],
)
def test_invalid_optimizer_settings(settings, fragment):
    with pytest.raises(ValueError) as err:
        TorchtitanEngineConfig(optimizer=settings)
    assert fragment in str(err.value)


def test_implementation_choice_lists_allowed():
    with pytest.raises(ValueError) as err:
        TorchtitanEngineConfig(optimizer=OptimizerSettings(implementation="fast"))
    assert "'foreach'" in str(err.value) and "'fused'" in str(err.value)


@pytest.mark.parametrize("mode,cls_name", [("selective", "SelectiveAC"), ("full", "FullAC"), ("none", None)])
def test_activation_checkpoint_maps_to_torchtitan_ac_config(mode, cls_name):
    ac = TorchtitanEngineConfig(activation_checkpoint=mode).ac_config()
    if cls_name is None:
        assert ac is None
    else:
        assert type(ac).__qualname__ == f"{cls_name}.Config"


def test_context_parallel_is_rejected_not_silently_ignored():
    # Review finding: cp=2 was accepted and trained on unsharded sequences.
    with pytest.raises(ValueError, match="cp=2 is not supported; allowed: 1"):
        TorchtitanEngineConfig(cp=2)


@pytest.mark.parametrize("torch_version,ok", [("2.13.0+cpu", False), ("2.11.0+cu130", False),
                                              ("2.14.1", True), ("2.15.0", True)])
def test_fsdp_under_spmd_types_needs_torch_2_14(torch_version, ok):
    from fixes.torchtitan.config import check_fsdp_supported

    check_fsdp_supported("spmd_types", 1, torch_version)  # no FSDP: always fine
    check_fsdp_supported("full_dtensor", 2, torch_version)  # not spmd_types: fine
    if ok:
        check_fsdp_supported("spmd_types", 2, torch_version)
    else:
        with pytest.raises(ValueError, match=r"needs torch >= 2\.14; torch .* rejects it") as err:
            check_fsdp_supported("spmd_types", 2, torch_version)
        assert torch_version in str(err.value) and "full_dtensor" in str(err.value)


def test_config_checks_fsdp_support_against_the_running_torch():
    import torch

    from fixes.torchtitan.config import FSDP_WITH_SPMD_TYPES_TORCH, release_tuple

    if release_tuple(torch.__version__) >= FSDP_WITH_SPMD_TYPES_TORCH:
        TorchtitanEngineConfig(dp_shard=2, spmd_backend="spmd_types")
    else:
        with pytest.raises(ValueError, match="needs torch >= 2.14"):
            TorchtitanEngineConfig(dp_shard=2, spmd_backend="spmd_types")


def test_parallel_sizes_reach_parallelism_config():
    p = TorchtitanEngineConfig(dp_shard=2, dp_replicate=3, tp=4, cp=1, ep=6, sequence_parallel=False,
                               spmd_backend="full_dtensor").parallelism_config()
    assert p.enable_sequence_parallel is False
    assert (
        p.data_parallel_shard_degree,
        p.data_parallel_replicate_degree,
        p.tensor_parallel_degree,
        p.context_parallel_degree,
        p.expert_parallel_degree,
        p.pipeline_parallel_degree,
    ) == (2, 3, 4, 1, 6, 1)


def test_optimizer_config_is_param_group_configs_first_match_order():
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    opt = OptimizerSettings(
        name="Adam",
        lr=2e-3,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.05,
        param_groups=(ParamGroupSettings(pattern=r"norm", weight_decay=0.0), ParamGroupSettings(pattern=r"lm_head", lr=1e-4)),
    )
    groups = TorchtitanEngineConfig(optimizer=opt).optimizer_config().param_groups
    assert all(isinstance(g, ParamGroupConfig) for g in groups)
    assert [g.pattern for g in groups] == ["norm", "lm_head", ".*"]
    assert {g.optimizer_name for g in groups} == {"Adam"}
    assert groups[0].optimizer_kwargs == {"lr": 2e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.0}
    assert groups[1].optimizer_kwargs["lr"] == 1e-4 and groups[1].optimizer_kwargs["weight_decay"] == 0.05
    assert groups[2].optimizer_kwargs["lr"] == 2e-3


def test_catch_all_group_dropped_when_groups_claim_every_parameter():
    opt = OptimizerSettings(param_groups=(ParamGroupSettings(pattern=r"weight", lr=1e-2),))
    cfg = TorchtitanEngineConfig(optimizer=opt)
    assert [g.pattern for g in cfg.optimizer_config(param_names=["a.weight", "b.weight"]).param_groups] == ["weight"]
    assert [g.pattern for g in cfg.optimizer_config(param_names=["a.weight", "a.bias"]).param_groups] == ["weight", ".*"]


def test_loss_config_is_torchtitan_cross_entropy():
    from torchtitan.components.loss import CrossEntropyLoss

    assert isinstance(TorchtitanEngineConfig().loss_config(), CrossEntropyLoss.Config)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        TorchtitanEngineConfig(1)  # type: ignore[misc]
