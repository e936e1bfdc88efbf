"""The one place that builds a real spmd mesh for repros, tests and benchmarks on one process.

spmd_types resolves a mesh from a named ``DeviceMesh`` (its axes come from the process groups),
so a mesh needs an initialised ``torch.distributed``. The smallest real setup is a gloo process
group of world size 1 on a ``FileStore`` in a private temporary directory: no port, no network,
no fake backend. spmd_types drops size-1 axes from the active set (``current_mesh()`` is then
``frozenset()``) but the mesh is still *current*, which is all ``assert_type(x, R)`` needs.
The mesh is a CPU mesh even when the tensors are on CUDA: these repros run no collective, and the
mesh's device type plays no part in the spmd_types state that recompute loses.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def ensure_process_group() -> None:
    """Initialise a gloo process group of world size 1 unless one exists (an engine's)."""
    if dist.is_initialized():
        return
    directory = tempfile.mkdtemp(prefix="stackfix-store-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    store = dist.FileStore(os.path.join(directory, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def ensure_fake_backend() -> None:
    """Register torch's ``fake`` c10d backend. torchtitan 0.3.0's ``ParallelDims.build_mesh``
    puts every disabled (size-1) mesh dim on it (``backend_override``), and torch 2.13 registers
    it only when ``torch.testing._internal.distributed.fake_pg`` is imported (torchtitan itself
    imports it only in its fake-mode init). Torch's own registration; no collective runs on it."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers it, once


def spmd_mesh(dim_name: str = "tp") -> DeviceMesh:
    """A 1-D CPU ``DeviceMesh`` over the whole (default) process group, with a named dim as
    spmd_types requires."""
    if not dim_name or not isinstance(dim_name, str):
        raise ValueError(f"dim_name must be a non-empty str, got {dim_name!r}")
    ensure_process_group()
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(dim_name,))
