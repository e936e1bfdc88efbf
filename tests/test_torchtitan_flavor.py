"""Flavor derivation: every llama3 / qwen3 flavor the installed torchtitan registers is found
again from the Hugging Face style config that describes it, with the layer-count fallbacks,
and a config that matches nothing names the nearest flavors."""

from __future__ import annotations

import pytest

from repro.harness.optional import require

pytestmark = pytest.mark.cpu

# The flavors are parametrized from torchtitan's own registries at collection time; torchtitan
# 0.3.0's models need torch >= 2.12 (torch 2.11 lacks DataParallelMeshDims): then skipped.
llama3, qwen3 = require("torchtitan.models.llama3", "torchtitan.models.qwen3")

from fixes.torchtitan.flavor import (  # noqa: E402
    derive_name_and_flavor,
    flavor_shapes,
    hf_shape,
    shape_of_model_config,
)

HF_MODEL_TYPE = {"llama3": "llama", "qwen3": "qwen3"}
REGISTERED = [("llama3", f) for f in llama3.llama3_configs] + [("qwen3", f) for f in qwen3.qwen3_configs]


def _hf_config(name: str, flavor: str, layer_key: str = "num_hidden_layers") -> dict:
    module = {"llama3": llama3, "qwen3": qwen3}[name]
    model = module.model_registry(flavor).model
    shape = shape_of_model_config(model)
    cfg = {"model_type": HF_MODEL_TYPE[name], "hidden_size": model.dim, "vocab_size": model.vocab_size}
    if layer_key == "layers":
        cfg["layers"] = [{} for _ in model.layers]
    else:
        cfg[layer_key] = len(model.layers)
    if shape.num_experts:
        cfg["model_type"] = "qwen3_moe"
        cfg["num_experts"] = shape.num_experts
    return cfg


def test_every_registered_flavor_is_covered():
    assert list(flavor_shapes("llama3")) == list(llama3.llama3_configs)
    assert list(flavor_shapes("qwen3")) == list(qwen3.qwen3_configs)


@pytest.mark.parametrize("name,flavor", REGISTERED, ids=[f"{n}-{f}" for n, f in REGISTERED])
def test_flavor_round_trips_through_its_hf_config(name, flavor):
    got_name, got_flavor = derive_name_and_flavor(_hf_config(name, flavor))
    assert got_name == name
    shapes = flavor_shapes(name)
    # Flavors a Hugging Face config cannot tell apart (qwen3 debugmodel vs
    # debugmodel_non_fused_qkv) resolve to the first in registry order.
    assert shapes[got_flavor] == shapes[flavor]
    first_with_shape = next(f for f, s in shapes.items() if s == shapes[flavor])
    assert got_flavor == first_with_shape


@pytest.mark.parametrize("layer_key", ["num_hidden_layers", "n_layers", "layers"])
def test_layer_count_fallbacks(layer_key):
    assert derive_name_and_flavor(_hf_config("llama3", "8B", layer_key)) == ("llama3", "8B")


def test_object_style_config_and_no_model_type():
    class HFConfig:
        hidden_size = 1024
        num_hidden_layers = 28
        vocab_size = 151936

    assert derive_name_and_flavor(HFConfig()) == ("qwen3", "0.6B")


def test_moe_flavor_not_taken_for_the_dense_one_of_the_same_shape():
    dense = derive_name_and_flavor(_hf_config("qwen3", "debugmodel"))
    moe = derive_name_and_flavor(_hf_config("qwen3", "debugmodel_moe"))
    assert dense == ("qwen3", "debugmodel") and moe == ("qwen3", "debugmodel_moe")


def test_no_match_lists_nearest_candidates():
    cfg = _hf_config("llama3", "8B")
    cfg["num_hidden_layers"] = 33
    with pytest.raises(ValueError) as err:
        derive_name_and_flavor(cfg)
    msg = str(err.value)
    assert "num_layers=33" in msg and "nearest: llama3/8B (hidden_size=4096, num_layers=32" in msg


def test_unknown_model_type_names_the_known_ones():
    with pytest.raises(ValueError, match="model_type 'mistral'.*'llama'.*'qwen3'"):
        derive_name_and_flavor({"model_type": "mistral", "hidden_size": 1, "num_hidden_layers": 1, "vocab_size": 1})


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match="hidden_size.*num_hidden_layers"):
        hf_shape({"vocab_size": 10})
