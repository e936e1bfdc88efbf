"""Recompute reclaim on real megatron-core models at real sizes: peak, retained and step time.

The reclaim exists for one leak: with full recompute, MoE training kept each checkpoint's
inputs and grads alive after backward (Megatron-LM #3221; verl #5251 frees them; Megatron-LM
#5197 fixed one cause on main, #5227 another: DeepEP's ``token_probs`` left on the dispatcher,
holding the recompute graph and through it the checkpoint's detached input and its grad).

Models (megatron-core ``GPTModel``, local spec, world size 1 -- or, with ``--ep N``, N ranks with
the experts split over them (expert parallelism, one GPU per rank; rank 0's figures) --, 4
layers, full uniform recompute of 1 layer, batch 1; fp32, or bf16 through megatron's
``Float16Module``):

- ``moe``: 8 experts, top-2, the ``allgather`` (or ``--dispatcher alltoall``) dispatcher, no
  linear biases -- as megatron ships it.
- ``moe-kept-probs``: the same, with the #5227 mechanism: each MoE layer keeps the routing
  probabilities of its last forward (the recompute's) until the next step.
- ``gpt-mtp``: a dense GPT with one Multi-Token-Prediction layer (its input is a chunk view
  of the decoder output).

Strategies: ``none``, ``verl-0.8.0`` and ``verl-0.9.1`` (verl's released reclaims, installed by
``repro.shared_view_reclaim.install_reclaim``), the rival fixes of the leak ``megatron-6339``
(Megatron-LM #6339: clear the detached inputs' ``.grad``) and ``gc-collect`` (radixark/miles
#2862: ``gc.collect()`` after each recomputed backward), both in ``repro.reclaims``, and
``ours`` (``fixes.megatron``). Each
strategy runs in a child interpreter of its own (one verl per process), every model, size and
dtype in it one after the other (one import of megatron-core, ~9 s on the H200 host, per
strategy): build, warm-up step, then ``gc`` off, the bytes of one measured step, then the
median of ``--steps`` timed steps.

Figures are absolute: bytes above what the built model holds (parameters, buffers, the batch),
never deltas across one step. The #3221 leak is state that one step leaves and the next step's
forward replaces (a dispatcher attribute set again by the next forward lets the old recompute
graph go), so in steady state a step retains nothing *more* than the step before it: measured
as a delta it is invisible, and it lowers the no-reclaim run's peak-over-its-start, which is
which made every reclaim look as if it cost peak memory. So:

- ``peak_bytes``: the highest the measured step goes, above the built model;
- ``retained_bytes``: live after the step, above the built model and the parameters' grads --
  the leak (0 for a model that keeps nothing between steps);
- ``requested_peak_bytes`` (CUDA): ``peak_bytes`` in the bytes tensors asked for (no allocator
  rounding);
- ``step_ms``: median step time; ``none_step_ms``: the median of no reclaim, timed in the same
  child interleaved step by step with it (``benchmarks._spread.interleaved``);
  ``step_time_ratio``: the median of the step-by-step ratios (the step-time cost of the
  reclaim), ``step_time_ratios`` each of them (their spread).

CUDA figures come from the caching allocator's statistics; CPU figures from
``torch.distributed._tools.mem_tracker.MemTracker`` (every storage since the build; reclaims'
``resize_(0)`` included).

    python -m benchmarks.megatron_scale --device cuda --out results.json
    python -m benchmarks.megatron_scale --device cpu --sizes 256x512 --dtypes fp32
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from benchmarks._meters import CpuMeter, CudaMeter
from benchmarks._spread import interleaved

MODELS = ("moe", "moe-kept-probs", "gpt-mtp")
MOE_MODELS = tuple(m for m in MODELS if m.startswith("moe"))
EXPERTS = 8  # per MoE layer; --ep splits them over ranks
# verl's released reclaims, the rival fixes (``repro.reclaims.RIVALS``), ours
STRATEGIES = ("none", "verl-0.8.0", "verl-0.9.1", "megatron-6339", "gc-collect", "ours")
DTYPES = ("fp32", "bf16")
DISPATCHERS = ("allgather", "alltoall")
SIZES = ((1024, 2048), (2048, 4096))  # (hidden, sequence)
MIB = 1024 * 1024


@dataclass
class Cell:
    model: str
    strategy: str
    dispatcher: str
    hidden: int
    seq: int
    dtype: str
    device: str = "cuda"
    expert_parallel: int = 1  # ranks the experts are split over (rank 0's figures)
    model_bytes: int = 0  # the built model and batch: what the figures below are above
    peak_bytes: int = 0
    # what tensors asked for at the peak (no allocator rounding): tells a real difference in
    # live tensors from the caching allocator's block sizes
    requested_peak_bytes: int = 0
    retained_bytes: int = 0  # live after the step beyond the model and the grads: the leak
    step_ms: float = 0.0  # median over --steps steps
    none_step_ms: float = 0.0  # no reclaim, timed interleaved with step_ms in the same process
    step_time_ratio: float = 0.0  # median of (this step / the adjacent no-reclaim step)
    step_time_ratios: list | None = None  # each of those ratios, in step order
    events: dict | None = None  # reclaim decisions of the measured step, by action
    # sha256 of every parameter's grad after the measured step (by name, raw bytes): equal
    # digests across strategies = bitwise equal gradients
    grads_sha256: str = ""
    peak_sites: list | None = None  # with --trace: the allocation sites live at the peak
    error: str | None = None


def _build(model: str, dispatcher: str, hidden: int, seq: int, dtype: str, device: str, *,
           aux_loss_coeff: float = 0.0, recompute: str = "full", layers: int = 4):
    """The model of a cell (``layers`` transformer layers). ``aux_loss_coeff`` (MoE models):
    megatron's load-balancing aux loss (and a z-loss a tenth of it) when > 0. ``recompute``:
    ``full`` (uniform, one layer per checkpoint) or ``moe-layer`` (selective: the MoE layer and
    core attention)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = dtype == "bf16"
    moe = model in MOE_MODELS
    granularity = (dict(recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1) if recompute == "full" else
                   dict(recompute_granularity="selective", recompute_modules=["moe", "core_attn"]))
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128,
        ffn_hidden_size=(hidden * 2 if moe else hidden * 4), **granularity,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=device == "cpu",
        **(dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
                moe_aux_loss_coeff=aux_loss_coeff,
                moe_z_loss_coeff=aux_loss_coeff / 10 if aux_loss_coeff > 0 else None)
           if moe else dict(mtp_num_layers=1)),
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None, moe_grouped_gemm=False)
    kwargs = {} if moe else dict(mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec,
                                                                       use_transformer_engine=False))
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=32000,
                   max_sequence_length=seq, **kwargs).to(device)
    if model == "moe-kept-probs":
        _keep_routing_probs(gpt)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(cfg, gpt)
    gpt.train()
    return gpt


def _keep_routing_probs(gpt) -> None:
    """Megatron-LM #5227's mechanism on the real MoE layers: each keeps the routing
    probabilities of its last forward on itself (DeepEP's manager kept ``token_probs``)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in gpt.modules():
        if isinstance(layer, MoELayer):
            route = layer.route

            def keeping_route(*args, _route=route, _layer=layer, **kwargs):
                out = _route(*args, **kwargs)
                _layer.stackfix_kept_probs = out[0]  # (probs, routing_map)
                return out

            layer.route = keeping_route


def _grads_digest(model) -> str:
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.grad is not None:
            digest.update(name.encode())
            digest.update(p.grad.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _measure(cell: Cell, steps: int, trace: bool = False,
             install: Callable[[str], None] | None = None) -> None:
    import torch

    from fixes.megatron import recompute_reclaim_events

    device = cell.device
    meter = CudaMeter(trace) if device == "cuda" else CpuMeter(trace)
    with meter.build():
        gpt = _build(cell.model, cell.dispatcher, cell.hidden, cell.seq, cell.dtype, device)
        ids = torch.randint(0, 32000, (1, cell.seq), device=device)
        pos = torch.arange(cell.seq, device=device).unsqueeze(0)
        mask = torch.ones(1, 1, cell.seq, cell.seq, dtype=torch.bool,
                          device=device).tril().logical_not()
        labels = torch.randint(0, 32000, (1, cell.seq), device=device)
        meter.sync()
        model_bytes = cell.model_bytes = meter.current()
        requested_model = meter.requested("current")

        def step():
            gpt.zero_grad(set_to_none=True)
            gpt(ids, pos, mask, labels=labels).float().sum().backward()

        step()  # warm-up: allocator, lazy state, the leak a step leaves for the next
    meter.sync()
    gc.collect()
    gc.disable()  # the worst case for a leak that is a reference cycle: no collection mid-step
    try:
        with meter.measured(), recompute_reclaim_events() as events:
            step()
        cell.peak_sites = meter.sites()
        grads = sum(p.grad.untyped_storage().nbytes() for p in gpt.parameters()
                    if p.grad is not None)
        cell.peak_bytes = meter.peak() - model_bytes
        cell.requested_peak_bytes = max(meter.requested("peak") - requested_model, 0)
        cell.retained_bytes = meter.current() - model_bytes - grads
        cell.grads_sha256 = _grads_digest(gpt)
        cell.events = {}
        for e in events:
            key = f"{e.role}:{e.action}"
            cell.events[key] = cell.events.get(key, 0) + 1
        # Step time, interleaved with no reclaim in this process (same model, same GPU state,
        # same moment): separate processes' medians differed by up to 15% from run to run.
        own = [cell.strategy] if install is None or cell.strategy == "none" else [cell.strategy, "none"]

        def timed_step(name: str) -> float:
            if len(own) > 1:
                install(name)
            meter.sync()
            t = time.perf_counter()
            step()
            meter.sync()
            return (time.perf_counter() - t) * 1e3

        times = interleaved(own, timed_step, steps)
        if len(own) > 1:
            install(cell.strategy)
        mine = times[cell.strategy]
        nones = times.get("none", mine)
        cell.step_ms = statistics.median(mine)
        cell.none_step_ms = statistics.median(nones)
        # step-by-step ratios (a clock or load drift over the run cancels out), every one kept
        # for the spread; the figure is their median
        cell.step_time_ratios = [a / b for a, b in zip(mine, nones, strict=True)]
        cell.step_time_ratio = statistics.median(cell.step_time_ratios)
    finally:
        gc.enable()


def run_child(models: str | Sequence[str], strategy: str, dispatcher: str, steps: int, sizes,
              dtypes, device: str = "cuda", trace: bool = False, ep: int = 1) -> list[Cell]:
    """Inside the child (one rank of it with ``ep`` > 1): one strategy, every model (one after
    the other, as the dtypes), size and dtype."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from repro.harness.megatron_world import setup_megatron
    from repro.reclaims import install_reclaim

    setup_megatron(device, expert_parallel=ep)
    if device == "cpu":
        from fixes.testing.megatron_cpu import install_megatron_cpu_moe_shim

        install_megatron_cpu_moe_shim()  # megatron's MoE router asks CUDA for its device

    def install(name: str) -> None:
        install_reclaim(name, CheckpointFunction)  # the harness's variant names

    install(strategy)
    cells = []
    for model, (hidden, seq), dtype in itertools.product(_model_list(models), sizes, dtypes):
        cell = Cell(model, strategy, dispatcher if model in MOE_MODELS else "-",
                    hidden, seq, dtype, device, ep)
        try:
            _measure(cell, steps, trace, install)
            gc.collect()  # the model of this cell goes before the next is built
        except Exception as e:  # noqa: BLE001 -- reported per cell, the others still run
            cell.error = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        cells.append(cell)
    return cells


def cells_in_child(models: str | Sequence[str], strategy: str, device: str, sizes, dtypes,
                   steps: int, dispatcher: str = "allgather", trace: bool = False,
                   ep: int = 1) -> list[dict]:
    """``run_child`` in a process of its own (one verl release per process; ``ep`` > 1: one per
    rank, rank 0's cells) for one model or several: its cells as dicts, or one cell with
    ``error`` (no ``hidden``) saying why the child produced none.

    The child is forked by the fork server (repro.harness.forkserver: torch, and megatron-core
    where the server can hold it, imported once, not once per child): on CPU each rank too, its
    figures MemTracker's bytes of the storages made after the child's build, which no import
    makes; on CUDA a one-rank child, its figures the device's peak and kept bytes since the
    child initialised CUDA (the server never does) and step times within the child. A spawned
    CUDA child paid a whole interpreter's start before measuring, and a session's children ran
    in waves (``benchmarks._children``): the refresh's memory sessions were mostly that wait
    (child start-up forked and spawned on the H200:
    ``benchmarks/results/evidence/2026-12-01-h200-session2/``). The ranks of a CUDA child with
    ``ep`` > 1 are spawned: NCCL ranks forked from the server have not run on two GPUs here."""
    from repro.harness.isolated import run_isolated, run_loopback_ranks

    size_arg = ",".join(f"{h}x{s}" for h, s in sizes)
    model = ",".join(_model_list(models))
    args = ["--child", model, strategy, "--device", device, "--dispatcher", dispatcher,
            "--steps", str(steps), "--sizes", size_arg, "--dtypes", ",".join(dtypes),
            "--ep", str(ep), *(["--trace"] if trace else [])]
    forked = device == "cpu" or ep == 1
    if ep == 1:
        res = run_isolated(module="benchmarks.megatron_scale", timeout=900, args=args,
                           forkserver=forked)
    else:
        ranks = run_loopback_ranks([sys.executable, "-m", "benchmarks.megatron_scale", *args], ep,
                                   timeout=900, env={"OMP_NUM_THREADS": "1"}, forkserver=forked)
        # a failed rank's collectives hang or fail the others: report the failed one
        res = next((r for r in ranks if not r.ok), ranks[0])
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("CELLS ")]
    if line:
        return json.loads(line[-1][len("CELLS "):])
    tail = (res.stderr.strip().splitlines() or [""])[-1]
    return [{"model": model, "strategy": strategy, "error": f"{res.describe()}: {tail[:400]}"}]


def _model_list(models: str | Sequence[str]) -> list[str]:
    """``"moe,gpt-mtp"`` or a sequence of names -> the names."""
    return [m for m in models.split(",") if m] if isinstance(models, str) else list(models)


def _choices(value: str, allowed, what: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"error: --{what} {value!r}: allowed {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megatron_scale",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--dispatcher", default="allgather", choices=DISPATCHERS)
    p.add_argument("--sizes", default=",".join(f"{h}x{s}" for h, s in SIZES),
                   help="hidden x sequence, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="timed steps per cell (median)")
    p.add_argument("--ep", type=int, default=1,
                   help=f"expert-parallel ranks (MoE models; CUDA: one GPU each); divides {EXPERTS}")
    p.add_argument("--out", help="write every cell as JSON")
    p.add_argument("--trace", action="store_true",
                   help="record the measured step's allocations; report the sites live at its peak")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "STRATEGY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models = _choices(args.models, MODELS, "models")
    strategies = _choices(args.strategies, STRATEGIES, "strategies")
    dtypes = _choices(args.dtypes, DTYPES, "dtypes")
    try:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    except ValueError:
        raise SystemExit(f"error: --sizes {args.sizes!r}: expected e.g. 1024x2048,2048x4096") from None
    splits = [n for n in range(1, EXPERTS + 1) if EXPERTS % n == 0]
    if args.ep not in splits:
        raise SystemExit(f"error: --ep {args.ep}: allowed {', '.join(map(str, splits))} "
                         f"(it splits the {EXPERTS} experts)")
    if args.child:
        _choices(args.child[0], MODELS, "child models")
    if args.ep > 1 and any(m not in MOE_MODELS for m in (_model_list(args.child[0]) if args.child
                                                         else models)):
        raise SystemExit(f"error: --ep {args.ep} needs MoE models only: --models "
                         f"{','.join(MOE_MODELS)}")
    if args.ep > 1 and args.device == "cuda" and not args.child:
        import torch

        if torch.cuda.device_count() < args.ep:
            raise SystemExit(f"error: --ep {args.ep} on cuda needs {args.ep} GPUs (one rank each); "
                             f"torch.cuda.device_count() is {torch.cuda.device_count()}")
    if args.child:
        cells = run_child(*args.child, args.dispatcher, args.steps, sizes, dtypes, args.device,
                          args.trace, args.ep)
        print("CELLS " + json.dumps([asdict(c) for c in cells]), flush=True)
        return 0

    cells: list[dict] = []
    for strategy in strategies:
        got = cells_in_child(models, strategy, args.device, sizes, dtypes, args.steps,
                             args.dispatcher, args.trace, args.ep)
        cells.extend(got)
        for c in got:
            print(_row(c) if "hidden" in c else f"{c['model']} {strategy}: {c['error']}",
                  file=sys.stderr, flush=True)
        if args.out:  # after every child: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(cells, f, indent=2)
    print(table(cells))
    return 1 if any(c.get("error") for c in cells) else 0


def _row(c: dict) -> str:
    return (f"{c['model']:15} {c['strategy']:11} {c.get('dispatcher', ''):9} "
            f"ep{c.get('expert_parallel', 1)} {c.get('hidden', '')}x{c.get('seq', '')} "
            f"{c.get('dtype', '')}")


def table(cells: list[dict]) -> str:
    """Per (model, dispatcher, expert-parallel ranks, size, dtype): each strategy's peak,
    retained, step time, and the ratios to ``none`` (measured side by side in one run)."""
    lines = ["model           dispatch  ep size       dtype strategy     peak MiB  /none   "
             "req. MiB  retained MiB  step ms  /none  error"]

    def key(c: dict) -> tuple:
        return (c["model"], c["dispatcher"], c.get("expert_parallel", 1), c["hidden"], c["seq"],
                c["dtype"])

    ref = {}
    for c in cells:
        if c.get("strategy") == "none" and not c.get("error"):
            ref[key(c)] = c
    for c in cells:
        if "hidden" not in c:
            lines.append(f"{c['model']:15} {'':9} {'':2} {'':10} {'':5} {c['strategy']:12} error: "
                         f"{c['error']}")
            continue
        r = ref.get(key(c))
        pk = f"{c['peak_bytes'] / r['peak_bytes']:.4f}" if r and r["peak_bytes"] else "-"
        st = f"{c['step_time_ratio']:.3f}" if c.get("step_time_ratio") else "-"
        lines.append(
            f"{c['model']:15} {c['dispatcher']:9} {c.get('expert_parallel', 1):2} "
            f"{c['hidden']}x{c['seq']:<5} {c['dtype']:5} "
            f"{c['strategy']:12} {c['peak_bytes'] / MIB:8.1f}  {pk:6}  "
            f"{c.get('requested_peak_bytes', 0) / MIB:8.1f}  {c['retained_bytes'] / MIB:12.1f}"
            f"  {c['step_ms']:7.1f}  {st:5}  {c.get('error') or ''}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
