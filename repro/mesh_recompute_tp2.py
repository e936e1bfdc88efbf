"""Crash 1, the silent variant: at TP=2 a recompute without the spmd mesh gives wrong gradients.

torchtitan's tensor-parallel collectives go through
``spmd_redistribute_per_axis(x, current_spmd_mesh(), ...)``, which returns ``x`` unchanged when
no mesh is current. Selective AC recomputes parts of each block inside ``backward()``; if the
backward runs after the mesh context (torchtitan's ``train_context``) was left -- as verl did
before #6950 -- the recomputed activations skip their all-gathers / reduce-scatters. Nothing
raises; the gradients are wrong. The unfixed run reports how far (max |grad - ref| and
sum|grad| against the reference, over every shard of both ranks).

Setting: real torchtitan llama3 ``debugmodel``, 2 CPU processes on gloo (127.0.0.1 only),
TP=2, no FSDP sharding, spmd_types backend, SDPA attention, selective AC, fp32, batch 1,
sequence 16. The oracle compares every local gradient shard with the same model trained
without AC (reference), both ranks:

- unfixed: forward inside ``engine.train_context()``, ``loss.backward()`` outside it, AC
  wrappers as torchtitan builds them -> gradients differ -> ``WrongResult`` with the
  measured difference.
- fixed: ``TorchtitanEngine.forward_backward_batch`` -> the reference gradients, exactly.

Under ``python -m repro --sanitize`` (storage and recompute sanitizers) the unfixed path raises
``RecomputeMismatchError`` at the first redistribution the recompute skips.

Run one side by hand: ``python -m repro.mesh_recompute_tp2 --fixed`` (or ``--unfixed``).
"""

from __future__ import annotations

import json
import sys

from repro.harness.ranks import rank_repro_main, run_rank_workers
from repro.registry import Repro, Signature, WrongResult

WORLD, SEQ, SEED = 2, 16, 0
_TIMEOUT = 420.0


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(engine) -> dict:
    return {
        n.replace("._checkpoint_wrapped_module", ""): _local(p.grad).detach().clone()
        for n, p in engine.model.named_parameters()
    }


def _engine(ac: str, mesh_preserving: bool):
    from fixes.torchtitan.config import TorchtitanEngineConfig
    from fixes.torchtitan.engine import TorchtitanEngine

    cfg = TorchtitanEngineConfig(
        tp=WORLD, dp_shard=1, sequence_parallel=False, attn_type="sdpa", spmd_backend="spmd_types",
        activation_checkpoint=ac, seed=SEED,
    )
    return TorchtitanEngine(
        cfg, name="llama3", flavor="debugmodel", seq_len=SEQ, device="cpu",
        mesh_preserving_recompute=mesh_preserving,
    )


def _unfixed_step(engine, batch) -> None:
    """verl before #6950: the mesh context covers the forward only."""
    import torch

    mb = batch[0]
    tokens = mb.tokens
    gvt = torch.tensor(tokens[:, 1:].numel())
    with engine.train_context():
        inputs, labels, extra = engine.prepare_micro_batch(mb)
        pred = engine.model(inputs, **extra)
        loss, _ = engine.loss_fn(pred, labels, gvt)
    loss.backward()  # selective-AC recompute runs here, with no current mesh


def worker(fixed: bool, out: str) -> None:
    """One rank (torchrun-style env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    import torch
    import torch.distributed as dist

    from fixes.torchtitan.engine import MicroBatch

    dist.init_process_group("gloo")
    try:
        g = torch.Generator().manual_seed(SEED)
        batch = [MicroBatch(torch.randint(0, 2048, (1, SEQ + 1), generator=g))]

        reference = _engine("none", mesh_preserving=True)
        reference.forward_backward_batch(batch)
        ref = _grads(reference)
        del reference

        engine = _engine("selective", mesh_preserving=fixed)
        if fixed:
            engine.forward_backward_batch(batch)
        else:
            _unfixed_step(engine, batch)
        got = _grads(engine)

        diff = torch.tensor(max(float((got[k] - ref[k]).abs().max()) for k in ref))
        sums = torch.tensor(
            [sum(float(v.abs().sum()) for v in ref.values()), sum(float(v.abs().sum()) for v in got.values())],
            dtype=torch.float64,
        )
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(
                    {"max_abs_diff": float(diff), "sum_abs_grad_ref": float(sums[0]),
                     "sum_abs_grad": float(sums[1]), "params": len(ref)}, f,
                )
        # Both ranks done with every collective before either tears gloo down: a peer that
        # closes first can abort the other ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fixed: bool, device: str) -> None:
    if device != "cpu":
        raise ValueError(f"mesh-recompute-tp2-silent-grad runs on CPU (gloo); got device={device!r}")
    from fixes.torchtitan.build import lm_attn_types, torchtitan_version
    from repro.registry import Skipped

    if "sdpa" not in lm_attn_types():  # the one attention with a CPU backward (config.ATTN_TYPES)
        raise Skipped(
            f"torchtitan {torchtitan_version()} builds no language-model attention with a CPU "
            f"backward: sdpa is not among {lm_attn_types()} (flat (T, N, H) attention), "
            "FlexAttention has no CPU backward, varlen no CPU kernel")
    result = run_rank_workers("repro.mesh_recompute_tp2", fixed, WORLD, timeout=_TIMEOUT - 20)
    print("TP2-GRADS " + json.dumps(result), flush=True)
    if result["max_abs_diff"] != 0.0:
        raise WrongResult(
            "TP=2 gradients differ from the no-AC reference: max |grad - ref| = "
            f"{result['max_abs_diff']:.3e}, sum|grad| {result['sum_abs_grad']:.6f} vs "
            f"{result['sum_abs_grad_ref']:.6f} over {result['params']} local shards per rank"
        )


REPROS = [
    Repro(
        name="mesh-recompute-tp2-silent-grad",
        summary="TP=2 torchtitan llama3, backward outside train_context: recompute skips its "
        "collectives, gradients silently wrong",
        run=run,
        signatures=(Signature(exception="WrongResult", message="TP=2 gradients differ"),),
        # The recompute sanitizer names the first collective the recompute skips (the mesh
        # sanitizer, with the mesh-recompute family, names the lost mesh itself).
        sanitized_signatures=(
            Signature(exception="RecomputeMismatchError", message="differs from its forward ("),
        ),
        sanitizers=("storage", "recompute"),
        devices=("cpu",),
        requires=("torchtitan",),
        timeout=_TIMEOUT,
        upstream="verl #6950, torchtitan #3565",
        forkserver="torchtitan",  # its ranks import torchtitan: forked with it imported
    ),
]


def main(argv: list[str] | None = None) -> int:
    return rank_repro_main("python -m repro.mesh_recompute_tp2", argv, run, worker)


if __name__ == "__main__":
    sys.exit(main())
