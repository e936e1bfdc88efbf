"""Crash 2 inside megatron-core: its ``CheckpointWithoutOutput`` keeps outputs that share storage.

verl's Megatron engine passes ``recompute_modules`` (``layernorm``, ``moe_act``, ...) through to
megatron-core, whose selective recompute runs those modules under ``CheckpointWithoutOutput``
and ``resize_(0)``\\ s every output's storage once the next module has read it. An output sharing
a checkpoint input's storage -- a fused-residual norm's ``(normed, residual)`` -- frees the input
under the residual add (Megatron-LM #4497; main keeps it only on opt-in, 19deef67). The plugin
installs ``fixes.megatron.apply_output_discard_patch`` as soon as megatron-core's
``tensor_parallel.random`` is imported, in every verl process: each output is freed only if no
other tensor shared its storage when it was made.
"""

from __future__ import annotations

from types import ModuleType

from fixes.verl.patch import VerlPatch, left_alone_at_install

MODULE = "megatron.core.tensor_parallel.random"


def install(module: ModuleType, version: str) -> None:
    if not isinstance(getattr(module, "CheckpointWithoutOutput", None), type):
        left_alone_at_install("megatron's CheckpointWithoutOutput discard", version,
                              f"{MODULE} has no CheckpointWithoutOutput")
        return
    from fixes.megatron import apply_output_discard_patch

    apply_output_discard_patch()


PATCH = VerlPatch(
    name="crash 2: megatron's CheckpointWithoutOutput frees only outputs no other tensor shares",
    module=MODULE,
    releases={"0.8.0": None, "0.9.1": None},
    install=install,
)
