"""vLLM's fused-MoE names across releases, resolved without importing vLLM at module load.

| vLLM        | ``fused_moe.layer.FusedMoE``          | ``RoutedExperts`` / ``MoERunner`` |
|-------------|---------------------------------------|-----------------------------------|
| <= 0.23     | the MoE layer class (owns the weights) | absent                            |
| 0.24 - 0.26 | a factory function returning MoERunner | present; RoutedExperts owns them  |
| >= 0.27     | gone (``FusedMoEFactory``)             | present                           |

verl #7328 made its ``FusedMoE`` import fall back to None for the last row; the MoE class tables
(verl's ``_MOE_STOP_CLASSES`` / ``_EXPERT_WEIGHT_CLASSES``) must then come from RoutedExperts /
MoERunner, and must never contain the 0.24-0.26 factory function: ``isinstance(x, FusedMoE)``
with a function raises ``TypeError: isinstance() arg 2 must be a type``.

Nothing is cached: every call looks at the vLLM currently importable (tests swap layouts).
"""

from __future__ import annotations

import importlib

_FUSED_MOE_PKG = "vllm.model_executor.layers.fused_moe"


def _lookup(module: str, name: str):
    """``module.name`` or None when vLLM, the module or the name is absent. Only ImportError is
    swallowed: a vLLM that is installed but fails to import for another reason stays loud."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(mod, name, None)


def resolve_fused_moe():
    """vLLM's ``FusedMoE``: the layer class (<= 0.23), the factory function (0.24-0.26), or None
    (>= 0.27, or no vLLM)."""
    return _lookup(f"{_FUSED_MOE_PKG}.layer", "FusedMoE")


def _present_classes(*names: str) -> tuple[type, ...]:
    found = []
    for name in names:
        obj = _lookup(_FUSED_MOE_PKG, name)
        if isinstance(obj, type):
            found.append(obj)
    return tuple(found)


def moe_layer_classes() -> tuple[type, ...]:
    """Every MoE layer class this vLLM has — the FusedMoE class (<= 0.23) and/or MoERunner and
    RoutedExperts (>= 0.24) — for ``isinstance`` checks that stop a module walk at an MoE layer.
    Empty without vLLM. Never contains the factory function."""
    fused = resolve_fused_moe()
    head = (fused,) if isinstance(fused, type) else ()
    return head + _present_classes("MoERunner", "RoutedExperts")


def expert_weight_classes() -> tuple[type, ...]:
    """The classes whose instances own the fused expert weights (``w13_weight``/``w2_weight``):
    the FusedMoE class (<= 0.23), RoutedExperts (>= 0.24). Empty without vLLM."""
    fused = resolve_fused_moe()
    head = (fused,) if isinstance(fused, type) else ()
    return head + _present_classes("RoutedExperts")
