"""stackfix's verl plugin: in every process that imports verl, verl's own patch points install
stackfix's fixes.

Loaded on ``import verl``: by verl >= 0.9 through the ``verl.plugins`` entry point this
distribution registers (``VERL_USE_EXTERNAL_PLUGINS``: ``auto``, the default, loads it), by any
verl through ``VERL_USE_EXTERNAL_MODULES=fixes.verl``. Ray workers import verl too, so each
worker loads it. ``STACKFIX_VERL_PLUGIN=0`` (or false, no, off) turns it off.

Per release (``fixes.verl.release.KNOWN``: 0.8.0, 0.9.1), each patch waits for the verl module
it changes and patches it as it is imported (``fixes.verl.post_import``), so the order of later
calls does not matter:

- crash 2, ``fixes.verl.reclaim``: ``apply_patch_megatron_recomputation_backward`` installs
  ``fixes.megatron``'s recompute reclaim (verl #7328, Megatron-LM #3221);
- crash 1, ``fixes.verl.torchtitan_engine``: ``TorchTitanEngine``'s activation checkpointing
  re-enters the spmd mesh in recompute, on any thread (verl #6950);
- crash 3, ``fixes.verl.mtp``: verl 0.8.0's MTP postprocess forwards ``mhc_multistream``;
- megatron-core 0.18.x, ``fixes.verl.mtp_recompute``: MTP with full recompute takes the
  ``padding_mask`` its forward passes (verl #7326, Megatron-LM #4933);
- vLLM refit, ``fixes.verl.vllm_refit``: left alone (why: its docstring).

Loading logs one WARNING line on logger ``fixes.verl``, naming the verl version, what it patches
and what it left alone (on a release it does not know: everything), or that the switch has it
off. It never raises: a ``STACKFIX_VERL_PLUGIN`` that is neither on nor off is logged as an
error naming the allowed values, and the plugin stays on (its default). Without verl, importing
this changes nothing and says nothing. ``fixes.verl.status()`` says what it did.
"""

from fixes.verl.plugin import PluginState, load, status

__all__ = ["PluginState", "load", "status"]

load()
