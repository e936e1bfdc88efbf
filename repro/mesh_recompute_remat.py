"""Crash 1 under torch_remat, the activation checkpointing torchtitan moves to (torchtitan #4497).

The model of ``repro.mesh_recompute`` (blocks whose forward calls ``spmd_types.assert_type(h,
R)``, resolved against the current mesh) is checkpointed with ``torch_remat.checkpoint`` instead
of ``torch.utils.checkpoint``: once with full recompute, once with the first matmul in a
``remat.region(..., recompute=False)`` (a SAVE region, whose replay is skipped). The forward runs
inside ``spmd_types.set_current_mesh``; backward runs after leaving it, on the main thread and
on a pool thread (and, on CUDA, inside the mesh on autograd's device thread). torch_remat replays the block inside ``backward()`` as torch does, so the
thread-local mesh is gone: ``SpmdTypeError: ... requires an active mesh``.

``mesh_preserving_context_fn`` does not apply: ``torch_remat.checkpoint`` takes no ``context_fn``
(torch-remat 0.2.2 raises TypeError). Fixed: ``fixes.torchtitan.mesh_preserving_remat_checkpoint``
passes a ``RecomputeStateHook`` that re-enters the forward's mesh. The oracle: every block
replayed, the replay saw the mesh, gradients bit-equal to the model without checkpointing.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import spmd_types as spmd
import torch
from torch import nn

from repro.mesh_recompute import (
    DIM,
    N_BLOCKS,
    SANITIZED_SIGNATURES,
    SEED,
    TOKENS,
    Probe,
    TypedBlock,
)
from repro.registry import Repro, Signature, WrongResult

AC_MODES = ("full", "save-region", "none")
# device-thread (CUDA only): forward *and* backward inside the mesh, autograd multithreading on,
# so the replay runs on autograd's CUDA device thread (on CPU it runs on the caller: no crash).
PLACEMENTS = {"cpu": ("main", "worker"), "cuda": ("main", "worker", "device-thread")}


class RematBlock(TypedBlock):
    """TypedBlock whose first matmul may sit in a torch_remat SAVE region."""

    def __init__(self, probe: Probe, save_region: bool):
        super().__init__(probe)
        self.save_region = save_region

    def forward(self, x):
        if not self.save_region:
            return super().forward(x)
        import torch_remat as remat

        self.probe.record()
        h = remat.region(self.w_in, "w_in", recompute=False)(x)
        remat.recompute_needs_tensor(h)
        spmd.assert_type(h, spmd.R)
        return x + self.w_out(torch.nn.functional.silu(h))


class RematModel(nn.Module):
    def __init__(self, ac: str, fixed: bool, probe: Probe):
        super().__init__()
        if ac not in AC_MODES:
            raise ValueError(f"ac must be one of {AC_MODES}, got {ac!r}")
        self.ac, self.fixed = ac, fixed
        self.blocks = nn.ModuleList(RematBlock(probe, ac == "save-region") for _ in range(N_BLOCKS))

    def forward(self, x):
        import torch_remat as remat

        from fixes.torchtitan import mesh_preserving_remat_checkpoint

        wrap = mesh_preserving_remat_checkpoint if self.fixed else remat.checkpoint
        for i, block in enumerate(self.blocks):
            x = block(x) if self.ac == "none" else wrap(region_name=f"blocks.{i}")(block)(x)
        return x.pow(2).sum()


def _step(ac: str, fixed: bool, placement: str, probe: Probe, device: str):
    """Forward inside the mesh, backward outside it on ``placement`` (device-thread: inside it,
    multithreading on); returns the grads."""
    from repro.harness.spmd_mesh import spmd_mesh

    torch.manual_seed(SEED)
    model = RematModel(ac, fixed, probe).to(device)
    x = torch.randn(TOKENS, DIM, device=device, requires_grad=True)
    mesh = spmd_mesh()

    def backward(loss):
        probe.phase = "backward"
        loss.backward()

    if placement == "device-thread":
        with torch.autograd.set_multithreading_enabled(True), spmd.set_current_mesh(mesh):
            backward(model(x))
    else:
        with spmd.set_current_mesh(mesh):
            loss = model(x)
        if placement == "main":
            backward(loss)
        else:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(backward, loss).result()
    return [p.grad for p in model.parameters()] + [x.grad]


def run(fixed: bool, device: str) -> None:
    if device not in PLACEMENTS:
        raise ValueError(f"device must be one of {tuple(PLACEMENTS)}, got {device!r}")
    reference = _step("none", False, "main", Probe(), device)
    crashes = {}
    for placement in PLACEMENTS[device]:
        for ac in ("full", "save-region"):
            where, probe = f"{placement}/{ac}", Probe()
            try:
                grads = _step(ac, fixed, placement, probe, device)
            except spmd.SpmdTypeError as exc:
                if fixed:
                    raise
                crashes[where] = exc
                continue
            if not fixed:
                continue
            replays = [c for c in probe.calls if c["phase"] == "backward"]
            if len(replays) != N_BLOCKS or any(c["mesh"] is None for c in replays):
                raise WrongResult(f"{where}: replays {replays}, expected {N_BLOCKS} with a mesh")
            if placement != "main" and replays[0]["thread"] == threading.get_ident():
                raise WrongResult(f"{where}: replay ran on the main thread, not another one")
            if not all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True)):
                raise WrongResult(f"{where}: gradients differ from the no-checkpoint reference")
    if not fixed:
        survivors = len(PLACEMENTS[device]) * 2 - len(crashes)
        if survivors:
            raise AssertionError(f"{survivors} cells kept the mesh in replay (did not reproduce); "
                                 f"crashed: {sorted(crashes)}")
        raise next(iter(crashes.values()))


REPROS = [
    Repro(
        forkserver="spmd",  # no megatron-core in its children
        name="mesh-recompute-remat",
        summary="torch_remat.checkpoint (torchtitan #4497): replay has no mesh; it takes no "
                "context_fn, so the fix rides its recompute_state_hooks",
        run=run, signatures=(Signature(exception="SpmdTypeError", message="requires an active mesh"),),
        sanitized_signatures=SANITIZED_SIGNATURES,
        devices=("cpu", "cuda"), requires=("torch_remat",), upstream="torchtitan #4497, #4614",
        timeout=180.0,
    ),
]
