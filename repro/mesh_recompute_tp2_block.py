"""Crash 1, silent, at TP=2 on spmd_types alone: the same wrong gradients as
``mesh-recompute-tp2-silent-grad`` without torchtitan's models, so it runs on two GPUs over NCCL
where those do not import (torch < 2.12), and over gloo on CPU.

spmd_types 0.2.3 has the collectives (``spmd_types.redistribute(x, "tp", src=P, dst=I)`` finds
the axis in the current mesh) but no helper that skips them: with no current mesh an axis-name
collective raises. The silent skip is torchtitan 0.3.0's ``spmd_redistribute_per_axis(x,
current_spmd_mesh(), ...)``, which returns ``x`` when there is no mesh. ``tp_redistribute`` below
keeps that contract, so this block behaves as torchtitan's TP layers do.

The block, per rank: two pre-norm MLPs with residuals in one activation checkpoint (as a
transformer block's attention and MLP are). Each MLP enters column-parallel (``I -> R``: no-op
forward, all-reduce of the input grad in backward), multiplies by its rank's rows of the up
weight and its columns of the down weight, and leaves row-parallel (``P -> I``: the all-reduce of
the partial sums). The second MLP's norm saves the first one's all-reduced output for backward:
the value a recompute without the mesh gets wrong.

Forward runs inside ``spmd_types.set_current_mesh``, backward after leaving it; every local
gradient shard is compared with the same model without AC, run inside the mesh:

- unfixed: plain non-reentrant checkpoint -> the recompute skips both all-reduces ->
  ``WrongResult`` with the difference and the count of skipped redistributions;
- under ``python -m repro --sanitize`` (storage and recompute sanitizers):
  ``RecomputeMismatchError`` at the first redistribution the recompute skips (the mesh
  sanitizer would name the lost mesh at the lookup before it: ``MeshLostError``);
- fixed: ``context_fn=fixes.torchtitan.mesh_preserving_context_fn`` -> the reference, exactly,
  with every redistribution of the recompute run (3 of the 4: recompute stops after the last
  saved activation).

CUDA: one process per GPU (NCCL), backward on autograd's device threads; ``Skipped`` with fewer
than two GPUs. ``python -m repro.mesh_recompute_tp2_block --fixed --device cuda`` runs one side.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from repro.harness.ranks import rank_repro_main, run_rank_workers
from repro.registry import Repro, Signature, Skipped, WrongResult

WORLD, DIM, HIDDEN, TOKENS, SEED = 2, 32, 64, 8, 0
N_MLPS = 2  # per checkpointed block
_TIMEOUT = 240.0

# How many TP redistributions ran / were skipped, by phase (forward, or recompute in backward).
REDISTRIBUTIONS: Counter = Counter()


def tp_redistribute(x: torch.Tensor, src, dst) -> torch.Tensor:
    """``x`` from ``src`` to ``dst`` on the current mesh's ``tp`` axis (spmd_types'
    redistribute: a collective or a backward-only conversion) -- and ``x`` unchanged when no
    mesh is current, the contract of torchtitan 0.3.0's ``spmd_redistribute_per_axis``."""
    import spmd_types as spmd

    phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
    if spmd.current_mesh() is None:
        REDISTRIBUTIONS[f"{phase}-skipped"] += 1
        return x
    REDISTRIBUTIONS[f"{phase}-run"] += 1
    return spmd.redistribute(x, "tp", src=src, dst=dst)


class TPMLP(nn.Module):
    """Pre-norm MLP with a residual, its two matmuls sharded over ``WORLD`` ranks."""

    def __init__(self, rank: int, generator: torch.Generator):
        super().__init__()
        shard = HIDDEN // WORLD
        # Full weights drawn alike on every rank, then this rank's shard kept.
        up = torch.randn(HIDDEN, DIM, generator=generator) / DIM**0.5
        down = torch.randn(DIM, HIDDEN, generator=generator) / HIDDEN**0.5
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Parameter(up[rank * shard : (rank + 1) * shard].clone())  # column-parallel
        self.down = nn.Parameter(down[:, rank * shard : (rank + 1) * shard].clone())  # row-parallel

    def forward(self, x):
        import spmd_types as spmd

        h = tp_redistribute(self.norm(x), spmd.I, spmd.R)
        partial = F.silu(h @ self.up.t()) @ self.down.t()
        return x + tp_redistribute(partial, spmd.P, spmd.I)


class TPBlock(nn.Module):
    def __init__(self, rank: int, ac: str):
        super().__init__()
        if ac not in ("none", "plain", "mesh_preserving"):
            raise ValueError(f"ac must be none, plain or mesh_preserving; got {ac!r}")
        g = torch.Generator().manual_seed(SEED)
        self.mlps = nn.ModuleList(TPMLP(rank, g) for _ in range(N_MLPS))
        self.ac = ac

    def _body(self, x):
        for mlp in self.mlps:
            x = mlp(x)
        return x

    def forward(self, x):
        if self.ac == "none":
            return self._body(x)
        from torch.utils.checkpoint import checkpoint

        kwargs = {}
        if self.ac == "mesh_preserving":
            from fixes.torchtitan import mesh_preserving_context_fn

            kwargs["context_fn"] = mesh_preserving_context_fn
        return checkpoint(self._body, x, use_reentrant=False, **kwargs)


def _step(block: TPBlock, x: torch.Tensor, mesh, backward_in_mesh: bool) -> dict:
    """Forward inside the mesh; backward inside it too or after it was left. Local grads."""
    import spmd_types as spmd

    with spmd.set_current_mesh(mesh):
        loss = block(x).pow(2).mean()
        if backward_in_mesh:
            loss.backward()
    if not backward_in_mesh:
        loss.backward()  # the recompute runs here, with no current mesh
    if x.is_cuda:
        torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters()}
    grads["input"] = x.grad.detach().clone()
    return grads


def worker(fixed: bool, device: str, out: str) -> None:
    """One rank (torchrun-style env: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = int(os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(device, (WORLD,), mesh_dim_names=("tp",))
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(SEED + 1))

        def run(ac: str, backward_in_mesh: bool) -> dict:
            block = TPBlock(rank, ac).to(device)
            return _step(block, x.to(device, copy=True).requires_grad_(), mesh, backward_in_mesh)

        reference = run("none", backward_in_mesh=True)
        REDISTRIBUTIONS.clear()
        got = run("mesh_preserving" if fixed else "plain", backward_in_mesh=False)

        diff = torch.tensor(max(float((got[k] - reference[k]).abs().max()) for k in reference),
                            device=device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"max_abs_diff": float(diff), "shards": len(reference),
                           "redistributions": dict(REDISTRIBUTIONS),
                           "sum_abs_grad_ref": sum(float(v.abs().sum()) for v in reference.values()),
                           "sum_abs_grad": sum(float(v.abs().sum()) for v in got.values())}, f)
        # Both ranks done with every collective before either tears gloo down: a peer that
        # closes first can abort the other ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fixed: bool, device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < WORLD:
        raise Skipped(f"needs {WORLD} GPUs (one NCCL rank each); "
                      f"torch.cuda.device_count() is {torch.cuda.device_count()}")
    result = run_rank_workers("repro.mesh_recompute_tp2_block", fixed, WORLD,
                              timeout=_TIMEOUT - 20, extra_args=("--device", device))
    print("TP2-BLOCK " + json.dumps(result), flush=True)
    counts = result["redistributions"]
    skipped, ran = counts.get("recompute-skipped", 0), counts.get("recompute-run", 0)
    if result["max_abs_diff"] != 0.0:
        raise WrongResult(
            f"TP=2 block gradients differ from the no-AC reference: max |grad - ref| = "
            f"{result['max_abs_diff']:.3e} (sum|grad| {result['sum_abs_grad']:.6f} vs "
            f"{result['sum_abs_grad_ref']:.6f}); the recompute skipped {skipped} TP "
            f"redistributions and ran {ran}"
        )
    # Non-reentrant checkpoint stops recomputing after the last saved activation, so not every
    # redistribution of the forward comes back; those that do must all have run.
    if skipped or not ran or counts.get("forward-run") != 2 * N_MLPS:
        raise WrongResult(f"expected {2 * N_MLPS} redistributions run in the forward and none "
                          f"skipped in the recompute; got {counts}")


REPROS = [
    Repro(
        forkserver="spmd",  # no megatron-core in its children
        name="mesh-recompute-tp2-block",
        summary="TP=2 column+row-parallel block on spmd_types (gloo / NCCL), backward outside the "
        "mesh: recompute skips its all-reduces, gradients silently wrong",
        run=run,
        signatures=(Signature(exception="WrongResult", message="TP=2 block gradients differ"),),
        # The recompute sanitizer names the first collective the recompute skips (the mesh
        # sanitizer, with the mesh-recompute family, names the lost mesh itself).
        sanitized_signatures=(
            Signature(exception="RecomputeMismatchError", message="differs from its forward ("),
        ),
        sanitizers=("storage", "recompute"),
        devices=("cpu", "cuda"),
        timeout=_TIMEOUT,
        upstream="verl #6950, torchtitan #3565",
    ),
]


def main(argv: list[str] | None = None) -> int:
    return rank_repro_main("python -m repro.mesh_recompute_tp2_block", argv, run, worker,
                           devices=("cpu", "cuda"))


if __name__ == "__main__":
    sys.exit(main())
