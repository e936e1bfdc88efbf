"""End-to-end smoke run of ``TorchtitanEngine`` over a configuration matrix.

``python -m repro.harness.engine_smoke`` trains a torchtitan model for ``--steps`` steps in every cell
of (parallel sizes x attn type x spmd backend x AC mode x compile), each cell in its own
process tree (``repro.run_isolated``: a crash or hang ends that cell only), and prints one row
per cell: ok with the first and last loss, or failed with the error. Exit status 1 if any cell
failed. A cell with more than one rank is launched torchrun-style -- one process per rank with
RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 / MASTER_PORT -- on gloo (CPU) or nccl (CUDA).

Seed: verl #6916's ``run_ppo_trainer_torchtitan.sh`` (env-configured parallel sizes, attn type,
spmd backend, AC mode), whose unquoted ``$HOME`` / ``$@`` / brackets the review flagged. This is
Python, so there is no shell quoting to get wrong; every option also reads an environment
variable (``STACKFIX_SMOKE_<OPTION>``) for CI, the flag wins.

Examples::

    python -m repro.harness.engine_smoke --attn sdpa --ac selective,full,none --steps 3
    python -m repro.harness.engine_smoke --parallel dp_shard=1 --parallel tp=2,dp_shard=1 \\
        --spmd-backend spmd_types,partial_dtensor
    STACKFIX_SMOKE_DEVICE=cuda STACKFIX_SMOKE_ATTN=flex,flex_flash python -m repro.harness.engine_smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass

PARALLEL_KEYS = ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep")
RESULT = "SMOKE-RESULT "
ERROR = "SMOKE-ERROR "
_ENV = "STACKFIX_SMOKE_"


@dataclass(frozen=True)
class Cell:
    parallel: dict
    attn_type: str
    spmd_backend: str
    activation_checkpoint: str
    compile: bool
    model: str
    flavor: str
    steps: int
    seq_len: int
    device: str

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p["dp_shard"] * p["dp_replicate"] * p["tp"] * p["pp"] * p["cp"]

    def label(self) -> str:
        sizes = ",".join(f"{k}={v}" for k, v in self.parallel.items() if v != 1 or k == "dp_shard")
        return (
            f"{sizes} {self.attn_type} {self.spmd_backend} ac={self.activation_checkpoint} "
            f"compile={'on' if self.compile else 'off'}"
        )


def parse_parallel(text: str) -> dict:
    """``"tp=2,dp_shard=1"`` -> every parallel size, unspecified ones 1."""
    sizes = dict.fromkeys(PARALLEL_KEYS, 1)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in PARALLEL_KEYS:
            raise ValueError(f"parallel size {item!r}: expected KEY=INT with KEY one of {PARALLEL_KEYS}")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise ValueError(f"parallel size {item!r}: {value!r} is not an int") from None
        if sizes[key] < 1:
            raise ValueError(f"parallel size {item!r}: sizes are >= 1 in a smoke cell")
    return sizes


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _compile_values(values: list[str]) -> list[bool]:
    table = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}
    bad = [v for v in values if v.lower() not in table]
    if bad:
        raise ValueError(f"--compile values {bad}: allowed on, off")
    return [table[v.lower()] for v in values]


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get

    def default(option: str, fallback: str) -> str:
        return env(_ENV + option.upper().replace("-", "_"), fallback)

    p = argparse.ArgumentParser(
        prog="python -m repro.harness.engine_smoke",
        description="TorchtitanEngine end-to-end smoke matrix (each option also reads "
        "STACKFIX_SMOKE_<OPTION>; comma-separated values span the matrix)",
    )
    p.add_argument("--parallel", action="append", default=None,
                   help="one cell's parallel sizes, e.g. 'tp=2,dp_shard=1' (repeatable; env: "
                   "';'-separated); default dp_shard=1")
    p.add_argument("--attn", default=default("attn", "sdpa"), help="flex,flex_flash,varlen,sdpa")
    p.add_argument("--spmd-backend", default=default("spmd-backend", "spmd_types"))
    p.add_argument("--ac", default=default("ac", "selective,full,none"), help="selective,full,none")
    p.add_argument("--compile", default=default("compile", "off"), help="off,on")
    p.add_argument("--model", default=default("model", "llama3"), help="llama3 or qwen3")
    p.add_argument("--flavor", default=default("flavor", "debugmodel"))
    p.add_argument("--steps", type=int, default=int(default("steps", "3")))
    p.add_argument("--seq-len", type=int, default=int(default("seq-len", "16")))
    p.add_argument("--device", choices=("cpu", "cuda"), default=default("device", "cpu"))
    p.add_argument("--timeout", type=float, default=float(default("timeout", "600")),
                   help="seconds per cell")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # internal: launch one cell
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one rank of one cell
    return p


def cells_from_args(args) -> list[Cell]:
    parallel_texts = args.parallel or _csv_semicolon(os.environ.get(_ENV + "PARALLEL", "dp_shard=1"))
    parallels = [parse_parallel(t) for t in parallel_texts]
    if args.steps < 2:
        raise ValueError("--steps must be >= 2 (a falling loss needs two)")
    cells = [
        Cell(parallel=par, attn_type=attn, spmd_backend=backend, activation_checkpoint=ac,
             compile=comp, model=args.model, flavor=args.flavor, steps=args.steps,
             seq_len=args.seq_len, device=args.device)
        for par, attn, backend, ac, comp in itertools.product(
            parallels, _csv(args.attn), _csv(args.spmd_backend), _csv(args.ac),
            _compile_values(_csv(args.compile)),
        )
    ]
    from fixes.torchtitan.config import TorchtitanEngineConfig

    for cell in cells:  # a typo fails here, with the allowed values, before any cell runs
        TorchtitanEngineConfig(
            **cell.parallel, attn_type=cell.attn_type, spmd_backend=cell.spmd_backend,
            activation_checkpoint=cell.activation_checkpoint, use_torch_compile=cell.compile,
        )
    return cells


def _csv_semicolon(text: str) -> list[str]:
    return [s.strip() for s in text.split(";") if s.strip()]


# ---- one rank ---------------------------------------------------------------------------------


def run_worker(cell: Cell) -> dict:
    """Train ``cell.steps`` steps on a fixed batch on this rank; return the losses."""
    import torch
    import torch.distributed as dist

    from fixes.torchtitan.config import TorchtitanEngineConfig
    from fixes.torchtitan.engine import MicroBatch, TorchtitanEngine

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cell.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cell.device == "cuda" else "gloo")
    try:
        cfg = TorchtitanEngineConfig(
            **cell.parallel,
            attn_type=cell.attn_type,
            spmd_backend=cell.spmd_backend,
            activation_checkpoint=cell.activation_checkpoint,
            use_torch_compile=cell.compile,
        )
        device = torch.device(cell.device, local_rank) if cell.device == "cuda" else "cpu"
        engine = TorchtitanEngine(cfg, name=cell.model, flavor=cell.flavor,
                                  seq_len=cell.seq_len, device=device)
        g = torch.Generator().manual_seed(0)
        batch = [MicroBatch(torch.randint(0, engine.model_config.vocab_size,
                                          (1, cell.seq_len + 1), generator=g))]
        losses = [engine.train_step(batch).loss for _ in range(cell.steps)]
    finally:
        dist.destroy_process_group()
    return {"losses": losses}


def _worker_main(cell_json: str) -> int:
    cell = Cell(**json.loads(cell_json))
    try:
        result = run_worker(cell)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then exit 1
        traceback.print_exc()
        print(ERROR + json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}),
              file=sys.stderr, flush=True)
        return 1
    if os.environ.get("RANK", "0") == "0":
        print(RESULT + json.dumps(result), flush=True)
    return 0


# ---- one cell (launcher) ------------------------------------------------------------------------


def _cell_main(cell_json: str) -> int:
    """Start one process per rank, torchrun-style, on 127.0.0.1; relay rank 0's result."""
    from repro.harness import forkserver
    from repro.harness.isolated import run_loopback_ranks

    cell = Cell(**json.loads(cell_json))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if cell.device == "cpu" else {}
    # no timeout here: the parent's run_isolated timeout kills this process group
    ranks = run_loopback_ranks(
        [sys.executable, "-m", "repro.harness.engine_smoke", "--worker", cell_json],
        cell.world_size, env=env, forkserver=forkserver.attached(),
    )
    for rank in ranks:
        sys.stdout.write(rank.stdout)
        sys.stderr.write(rank.stderr)
    return 0 if all(rank.ok for rank in ranks) else 1


# ---- the matrix -----------------------------------------------------------------------------------


def _find(prefix: str, text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def _last_error_line(stderr: str) -> str:
    for line in reversed(stderr.splitlines()):
        s = line.strip()
        if s and ("Error" in s.split(":")[0] or "Exception" in s.split(":")[0]):
            return s[:300]
    return (stderr.strip().splitlines() or ["(no output)"])[-1][:300]


def run_cell(cell: Cell, timeout: float) -> dict:
    from repro import run_isolated
    from repro.harness import forkserver

    start = time.monotonic()
    # Forked by the fork server when this process was (a test runs the matrix so), else spawned.
    res = run_isolated(module="repro.harness.engine_smoke", args=["--cell", json.dumps(asdict(cell))],
                       timeout=timeout, forkserver=forkserver.attached())
    row = {"cell": cell.label(), "seconds": round(time.monotonic() - start, 1)}
    result = _find(RESULT, res.stdout)
    if res.ok and result is not None:
        losses = result["losses"]
        falling = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        row.update(status="ok" if falling else "failed", losses=losses,
                   detail=f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
                   + ("" if falling else " (did not fall)"))
        return row
    reported = _find(ERROR, res.stderr)
    detail = reported["error"] if reported else _last_error_line(res.stderr)
    if res.timed_out or res.signal is not None:
        detail = f"{res.describe()}: {detail}"
    row.update(status="failed", detail=detail)
    return row


def print_table(rows: list[dict]) -> None:
    width = max([len(r["cell"]) for r in rows] + [4])
    print(f"{'cell':<{width}}  status  seconds  detail")
    for r in rows:
        print(f"{r['cell']:<{width}}  {r['status']:<6}  {r['seconds']:>7}  {r['detail']}")
    bad = sum(r["status"] != "ok" for r in rows)
    print(f"\n{len(rows) - bad} ok, {bad} failed")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)
    if args.cell:
        return _cell_main(args.cell)
    try:
        cells = cells_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    rows = []
    for cell in cells:
        row = run_cell(cell, args.timeout)
        print(f"[{len(rows) + 1}/{len(cells)}] {row['status']:<6} {row['cell']}: {row['detail']}",
              flush=True)
        rows.append(row)
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
