"""vLLM compatibility for RL weight refit (crash 3's companion fixes, verl #7328).

``FusedMoE`` is resolved on attribute access (module ``__getattr__``), so ``import fixes.vllm``
never imports vLLM; without vLLM, or on vLLM >= 0.27 where the name is gone, it is None.
``mtp_refit_completeness`` checks a whole bucketed refit for its MTP weights (vLLM >= 0.34
checks nothing).
"""

from fixes.vllm.moe_layers import expert_weight_classes, moe_layer_classes, resolve_fused_moe
from fixes.vllm.mtp_check import has_mtp_completeness_check, mtp_completeness_check_disabled
from fixes.vllm.mtp_refit import MtpRefit, MtpWeightsMissingError, mtp_refit_completeness
from fixes.vllm.refit import load_refit_weights, parameter_subclasses_restored

__all__ = [
    "FusedMoE",
    "MtpRefit",
    "MtpWeightsMissingError",
    "expert_weight_classes",
    "has_mtp_completeness_check",
    "load_refit_weights",
    "moe_layer_classes",
    "mtp_completeness_check_disabled",
    "mtp_refit_completeness",
    "parameter_subclasses_restored",
    "resolve_fused_moe",
]


def __getattr__(name: str):
    if name == "FusedMoE":
        return resolve_fused_moe()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
