"""Crash 1: verl's ``TorchTitanEngine`` recomputes with the spmd mesh, on whatever thread.

spmd_types keeps the current mesh thread-locally. verl 0.9.1 turns autograd multithreading off
once, in ``TorchTitanEngine._init_device_mesh`` (verl #6950), which holds only for the thread
that ran the init: a step on another thread (a thread-pool actor) backpropagates CUDA tensors
on autograd's device thread, where the mesh is not set, and the activation-checkpoint recompute
raises "requires an active mesh" (or, at TP > 1, silently skips its collectives). verl 0.8.0
does not turn it off at all, and its ``forward_backward_batch`` calls ``loss.backward()``
outside torchtitan's ``train_context`` (only the forward is inside it), so no mesh is set on
*any* thread during its recompute.

Which fix, and why: ``fixes.torchtitan.mesh_preserving_context_fn`` in the engine's activation
checkpointing, not ``single_threaded_backward`` around its backward. The context_fn captures
the mesh each time a checkpointed forward runs (so per step, per micro-batch) and re-enters it
in that block's recompute, on whichever thread autograd runs it, inside or outside the train
context: it covers both releases' failure, while single-threaded backward only helps where the
backward runs inside the train context on the step's thread (0.9.1, not 0.8.0). It changes no
threading and no op the recompute runs (same bytes, same FLOPs).

Where: torchtitan's ``Trainer`` applies AC (its ``CheckpointWrapper``\\ s) to the model parts in
``TorchTitanEngine.__init__``, which then calls ``_init_device_mesh`` (0.8.0 and 0.9.1); the
plugin wraps ``_init_device_mesh`` to make every wrapper of ``self.trainer.model_parts``
mesh-preserving once verl's own init has run. The engine module is patched when it is imported
(``fixes.verl.post_import``): verl 0.9.1's imports torchtitan names torchtitan 0.3.0 lacks
(``torchtitan.components.lr_scheduler``), so importing it from the plugin would fail there.
"""

from __future__ import annotations

import functools
from types import ModuleType

from fixes.verl.patch import VerlPatch, left_alone_at_install, logger

MODULE = "verl.workers.engine.torchtitan.transformer_impl"
ENGINE = "TorchTitanEngine"
METHOD = "_init_device_mesh"
_MARK = "_stackfix_mesh_preserving_ac"


def make_engine_ac_mesh_preserving(engine) -> int:
    """Make every activation-checkpoint wrapper of ``engine.trainer.model_parts`` mesh-preserving
    (idempotent); returns how many there are."""
    from fixes.torchtitan import make_checkpoint_wrappers_mesh_preserving

    return sum(make_checkpoint_wrappers_mesh_preserving(part)
               for part in engine.trainer.model_parts)


def patch_engine_class(cls: type) -> bool:
    """Wrap ``cls._init_device_mesh`` (verl's, run as shipped) so that the model parts' AC is
    mesh-preserving after it. False if already wrapped."""
    init = cls.__dict__[METHOD]
    if getattr(init, _MARK, False):
        return False

    @functools.wraps(init)
    def _init_device_mesh(self, *args, **kwargs):
        result = init(self, *args, **kwargs)
        # The recompute re-enters the forward's mesh on any thread (verl #6950's init-time
        # set_multithreading_enabled(False) covers the init thread only).
        count = make_engine_ac_mesh_preserving(self)
        logger.info("stackfix verl plugin: %d activation-checkpoint wrapper(s) of %s keep the "
                    "spmd mesh in recompute", count, type(self).__name__)
        return result

    setattr(_init_device_mesh, _MARK, True)
    setattr(cls, METHOD, _init_device_mesh)
    return True


def install(module: ModuleType, version: str) -> None:
    cls = getattr(module, ENGINE, None)
    if cls is None or METHOD not in cls.__dict__:
        left_alone_at_install("TorchTitanEngine's activation checkpointing", version,
                              f"{MODULE} has no {ENGINE}.{METHOD}")
        return
    patch_engine_class(cls)


PATCH = VerlPatch(
    name="crash 1: TorchTitanEngine's recompute keeps the spmd mesh",
    module=MODULE,
    releases={"0.8.0": None, "0.9.1": None},
    install=install,
)
