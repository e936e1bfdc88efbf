"""Which torchtitan (model, flavor) a Hugging Face style config describes.

Seed: verl #6231's ``derive_torchtitan_name_and_flavor``. The flavors are read from the
installed torchtitan (each model module's ``<name>_configs`` registry, every flavor built
through ``model_registry(flavor)``), never from a copied table, so a torchtitan release that
adds or resizes a flavor is matched as it ships. Layer counts come from ``n_layers`` where a
model config has it and ``len(layers)`` otherwise (torchtitan 0.3.0 configs carry a list of
per-layer configs and no ``n_layers``).

A config is matched on hidden size, layer count and vocabulary size, plus the number of
experts (0 for dense) so that a MoE flavor is not mistaken for the dense one of the same
shape. Flavors that differ only in ways a Hugging Face config cannot show (qwen3
``debugmodel`` vs ``debugmodel_non_fused_qkv``: fused or separate QKV weights) resolve to the
first one in torchtitan's registry order.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FlavorShape",
    "TORCHTITAN_MODELS",
    "derive_name_and_flavor",
    "flavor_shapes",
    "hf_shape",
]

# Hugging Face ``model_type`` -> the torchtitan model module that implements it.
TORCHTITAN_MODELS: Mapping[str, str] = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3"}


@dataclass(frozen=True, slots=True)
class FlavorShape:
    """What a Hugging Face config can tell about a flavor."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_experts: int = 0

    def mismatches(self, other: FlavorShape) -> int:
        return sum(a != b for a, b in zip(self._values(), other._values(), strict=True))

    def _values(self):
        return (self.hidden_size, self.num_layers, self.vocab_size, self.num_experts)

    def describe(self) -> str:
        experts = f", num_experts={self.num_experts}" if self.num_experts else ""
        return (
            f"hidden_size={self.hidden_size}, num_layers={self.num_layers}, "
            f"vocab_size={self.vocab_size}{experts}"
        )


def _model_module(name: str):
    return importlib.import_module(f"torchtitan.models.{name}")


def _flavor_names(module) -> list[str]:
    """The flavors a torchtitan model module registers: its exported ``*_configs`` dict."""
    for attr in getattr(module, "__all__", ()):
        table = getattr(module, attr, None)
        if attr.endswith("_configs") and isinstance(table, dict):
            return list(table)
    raise ValueError(f"{module.__name__} exports no '<name>_configs' flavor registry")


def _num_layers(model_config) -> int:
    n_layers = getattr(model_config, "n_layers", None)
    if n_layers:
        return int(n_layers)
    return len(getattr(model_config, "layers", None) or ())


def _num_experts(model_config) -> int:
    for layer in getattr(model_config, "layers", None) or ():
        moe = getattr(layer, "moe", None)
        if moe is not None:
            return int(getattr(moe, "num_experts", 0) or 0)
    return 0


def shape_of_model_config(model_config) -> FlavorShape:
    """The FlavorShape of a torchtitan model config (``model_registry(flavor).model``)."""
    return FlavorShape(
        hidden_size=int(model_config.dim),
        num_layers=_num_layers(model_config),
        vocab_size=int(model_config.vocab_size),
        num_experts=_num_experts(model_config),
    )


@functools.cache
def flavor_shapes(name: str) -> dict[str, FlavorShape]:
    """Every flavor torchtitan registers for model ``name``, in registry order, with its shape.
    Built through ``model_registry(flavor)`` (configs only: no parameters are allocated)."""
    module = _model_module(name)
    return {
        flavor: shape_of_model_config(module.model_registry(flavor).model)
        for flavor in _flavor_names(module)
    }


def _get(hf_config, key, default=None):
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def hf_shape(hf_config) -> FlavorShape:
    """The FlavorShape a Hugging Face config (a ``PretrainedConfig`` or its dict) describes.
    The layer count is ``num_hidden_layers``, else ``n_layers``, else ``len(layers)``."""
    missing = [k for k in ("hidden_size", "vocab_size") if _get(hf_config, k) is None]
    num_layers = _get(hf_config, "num_hidden_layers") or _get(hf_config, "n_layers")
    if num_layers is None and _get(hf_config, "layers") is not None:
        num_layers = len(_get(hf_config, "layers"))
    if num_layers is None:
        missing.append("num_hidden_layers (or n_layers, or layers)")
    if missing:
        raise ValueError(f"the Hugging Face config lacks {', '.join(missing)}")
    experts = _get(hf_config, "num_experts") or _get(hf_config, "num_local_experts") or 0
    return FlavorShape(
        hidden_size=int(_get(hf_config, "hidden_size")),
        num_layers=int(num_layers),
        vocab_size=int(_get(hf_config, "vocab_size")),
        num_experts=int(experts),
    )


def derive_name_and_flavor(hf_config) -> tuple[str, str]:
    """``(torchtitan model name, flavor)`` for a Hugging Face style config.

    ``model_type`` picks the torchtitan model (``llama`` -> llama3, ``qwen3``/``qwen3_moe``
    -> qwen3); without one every known model is searched. No exact match raises ValueError
    listing the nearest registered flavors and their shapes.
    """
    model_type = _get(hf_config, "model_type")
    if model_type is None:
        names = sorted(set(TORCHTITAN_MODELS.values()))
    elif model_type in TORCHTITAN_MODELS:
        names = [TORCHTITAN_MODELS[model_type]]
    else:
        raise ValueError(
            f"model_type {model_type!r} has no torchtitan model here; allowed: "
            f"{', '.join(map(repr, TORCHTITAN_MODELS))}"
        )
    wanted = hf_shape(hf_config)
    candidates = [
        (name, flavor, shape) for name in names for flavor, shape in flavor_shapes(name).items()
    ]
    for name, flavor, shape in candidates:
        if shape == wanted:
            return name, flavor

    def distance(item):
        shape = item[2]
        return (
            shape.mismatches(wanted),
            abs(shape.hidden_size - wanted.hidden_size) / max(wanted.hidden_size, 1),
            abs(shape.num_layers - wanted.num_layers),
        )

    nearest = sorted(candidates, key=distance)[:3]
    listing = "; ".join(f"{n}/{f} ({s.describe()})" for n, f, s in nearest)
    raise ValueError(
        f"no torchtitan flavor of {', '.join(names)} matches {wanted.describe()}; "
        f"nearest: {listing}"
    )
