"""Fixes for torchtitan-based engines (crash 1: the spmd mesh lost in activation-checkpoint
recompute). Importing this package needs only torch and spmd_types: nothing here imports
torchtitan or torch_remat at import time (add new exports as plain imports below; keep those
imports inside functions)."""

from fixes.torchtitan.backward_threads import single_threaded_backward  # noqa: F401
from fixes.torchtitan.config import (  # noqa: F401
    OptimizerSettings,
    ParamGroupSettings,
    TorchtitanEngineConfig,
)
from fixes.torchtitan.engine import MicroBatch, StepResult, TorchtitanEngine  # noqa: F401
from fixes.torchtitan.flavor import derive_name_and_flavor  # noqa: F401
from fixes.torchtitan.mesh_checkpoint import (  # noqa: F401
    make_checkpoint_wrappers_mesh_preserving,
    mesh_preserving,
    mesh_preserving_context_fn,
)
from fixes.torchtitan.remat_mesh import (  # noqa: F401
    MeshRecomputeStateHook,
    RematUnsupported,
    mesh_preserving_remat_checkpoint,
)
