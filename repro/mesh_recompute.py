"""Crash 1: the spmd mesh is lost in activation-checkpoint recompute (verl #6950, torchtitan #3565).

A two-block model whose forward calls ``spmd_types.assert_type(h, R)`` -- a bare type, resolved
against the *current* mesh, as torchtitan's attention does -- is run under
``torch.utils.checkpoint`` (non-reentrant) with a torchtitan-style selective policy and with full
AC. spmd_types keeps the current mesh in a thread-local stack, and recompute runs inside
``backward()``:

- ``mesh-recompute``: forward inside ``set_current_mesh``, backward after leaving it.
- ``mesh-recompute-thread``: forward inside the mesh on the main thread, backward on another.
- ``mesh-recompute-device-thread`` (CUDA): forward *and* backward inside the mesh, but autograd
  multithreading is on, so recompute runs on the autograd CUDA device thread.
- ``mesh-recompute-init-thread`` (CUDA): the upstream fix -- multithreading turned off once at
  "init" on the main thread -- and the step on a thread-pool thread: the setting is
  thread-local, so recompute still runs on the device thread.

Each raises ``SpmdTypeError: assert_type(...) requires an active mesh``. Fixed: the mesh-preserving
``context_fn`` (all four) and, where backward runs inside the mesh context, single-threaded
backward around the step (the two CUDA thread cases). A fixed run must give gradients bit-equal
to the model without AC, recompute every checkpointed block, and see the mesh in recompute.

``python -m repro.mesh_recompute --matrix --device cpu`` prints every (placement, AC, fix) cell as
a JSON line; tests/test_mesh_recompute.py asserts on them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import spmd_types as spmd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from repro.registry import Repro, Signature, WrongResult

PLACEMENTS = ("main", "worker", "init-thread", "device-thread")
AC_MODES = ("selective", "full", "none")
FIXES = ("none", "context_fn", "single_threaded_backward")
# Placements whose step runs forward and backward inside the mesh context (as a fixed engine
# does); they crash only on CUDA, where backward moves to autograd's device threads.
IN_MESH_STEP_PLACEMENTS = ("device-thread", "init-thread")
N_BLOCKS, DIM, TOKENS, SEED = 2, 16, 8, 0
_MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def torchtitan_style_policy():
    """A fresh selective-AC policy in the manner of torchtitan's SelectiveAC: save matmul
    outputs except every second one (counted separately in forward and recompute, so both
    make the same decisions), recompute everything else. Stateful: one per checkpoint call."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _MM_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@dataclass
class Probe:
    """Where each block's forward ran and which mesh it saw; ``phase`` is set by the driver."""

    phase: str = "forward"
    calls: list = field(default_factory=list)

    def record(self) -> None:
        self.calls.append({"phase": self.phase, "thread": threading.get_ident(),
                           "mesh": _mesh_names()})


def _mesh_names():
    names = spmd.current_mesh_all_names()
    return None if names is None else sorted(names)


class TypedBlock(nn.Module):
    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe
        self.w_in = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w_out = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        self.probe.record()
        h = self.w_in(x)
        spmd.assert_type(h, spmd.R)  # a bare type needs the current mesh
        return x + self.w_out(F.silu(h))


class TypedModel(nn.Module):
    def __init__(self, ac: str, fix: str, probe: Probe):
        super().__init__()
        if ac not in AC_MODES:
            raise ValueError(f"ac must be one of {AC_MODES}, got {ac!r}")
        if fix not in FIXES:
            raise ValueError(f"fix must be one of {FIXES}, got {fix!r}")
        self.ac, self.fix = ac, fix
        self.blocks = nn.ModuleList(TypedBlock(probe) for _ in range(N_BLOCKS))

    def _context_fn(self):
        from fixes.torchtitan import mesh_preserving_context_fn

        if self.fix == "context_fn":
            if self.ac == "full":
                return mesh_preserving_context_fn
            return lambda: mesh_preserving_context_fn(torchtitan_style_policy())
        if self.ac == "full":
            return None  # torch's default (noop) context_fn
        return lambda: create_selective_checkpoint_contexts(torchtitan_style_policy())

    def forward(self, x):
        for block in self.blocks:
            if self.ac == "none":
                x = block(x)
                continue
            kwargs = {} if (fn := self._context_fn()) is None else {"context_fn": fn}
            x = checkpoint(block, x, use_reentrant=False, **kwargs)
        return x.pow(2).sum()


@dataclass
class Cell:
    """One run: where things ran, what recompute saw, and how it ended."""

    placement: str
    ac: str
    fix: str
    device: str
    error: dict | None = None
    main_thread: int = field(default_factory=lambda: threading.main_thread().ident)
    forward_thread: int | None = None
    backward_caller: int | None = None
    recompute: list = field(default_factory=list)  # probe calls during backward
    after_recompute: dict | None = None  # thread / mesh seen by x's grad hook, after recompute
    caller_mesh_before: list | None = None
    caller_mesh_after: list | None = None
    grads_equal: bool | None = None
    exc: BaseException | None = field(default=None, repr=False)

    def as_json(self) -> str:
        data = asdict(self)
        data.pop("exc")
        return json.dumps(data)


def build_model(ac: str, fix: str, device: str, probe: Probe):
    """The seeded TypedModel and its input (leaf, requires grad): the same weights every call."""
    torch.manual_seed(SEED)
    model = TypedModel(ac, fix, probe).to(device)
    x = torch.randn(TOKENS, DIM, device=device, requires_grad=True)
    return model, x


def grads_of(model, x):
    """Copies of every parameter's grad, then x's."""
    return [p.grad.detach().clone() for p in model.parameters()] + [x.grad.detach().clone()]


@functools.cache
def _reference_grads(device: str):
    """Gradients without activation checkpointing (no recompute, so no mesh question)."""
    from repro.harness.spmd_mesh import spmd_mesh

    model, x = build_model("none", "none", device, Probe())
    with spmd.set_current_mesh(spmd_mesh()):
        model(x).backward()
    return grads_of(model, x)


def _maybe_single_threaded(fix: str):
    from fixes.torchtitan import single_threaded_backward

    return single_threaded_backward() if fix == "single_threaded_backward" else contextlib.nullcontext()


def run_cell(placement: str, ac: str, fix: str, device: str) -> Cell:
    """Run one scenario; exceptions are kept on the Cell (``exc``), never swallowed silently."""
    from repro.harness.spmd_mesh import spmd_mesh

    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    mesh = spmd_mesh()
    reference = _reference_grads(device)
    probe = Probe()
    model, x = build_model(ac, fix, device, probe)
    cell = Cell(placement, ac, fix, device)
    x.register_hook(lambda g: setattr(cell, "after_recompute", {
        "thread": threading.get_ident(), "mesh": _mesh_names()}))

    def backward(loss):
        cell.backward_caller = threading.get_ident()
        cell.caller_mesh_before = _mesh_names()
        probe.phase = "backward"
        try:
            loss.backward()
        finally:
            cell.caller_mesh_after = _mesh_names()

    def step():  # forward and backward inside the mesh context, as a fixed engine does
        with _maybe_single_threaded(fix), spmd.set_current_mesh(mesh):
            cell.forward_thread = threading.get_ident()
            backward(model(x))

    try:
        if placement in ("main", "worker"):
            with spmd.set_current_mesh(mesh):
                cell.forward_thread = threading.get_ident()
                loss = model(x)

            def backward_outside_mesh():
                with _maybe_single_threaded(fix):
                    backward(loss)

            if placement == "main":
                backward_outside_mesh()
            else:
                with ThreadPoolExecutor(1) as pool:
                    pool.submit(backward_outside_mesh).result()
        elif placement == "device-thread":
            with torch.autograd.set_multithreading_enabled(True):  # torch's default, explicit
                step()
        else:  # init-thread: verl #6950's fix, set once at init on the main thread
            with torch.autograd.set_multithreading_enabled(False), ThreadPoolExecutor(1) as pool:
                pool.submit(step).result()
    except Exception as exc:  # noqa: BLE001 - reported on the cell, re-raised by the repros
        cell.exc = exc
        cell.error = {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    cell.recompute = [c for c in probe.calls if c["phase"] == "backward"]
    if cell.error is None:
        cell.grads_equal = all(torch.equal(a, b) for a, b in zip(grads_of(model, x), reference,
                                                                 strict=True))
    return cell


def _unfixed(placement: str):
    def run(fixed: bool, device: str) -> None:
        if fixed:
            return _fixed(placement, device)
        cells = [run_cell(placement, ac, "none", device) for ac in ("selective", "full")]
        survivors = [c.ac for c in cells if c.exc is None]
        if survivors:
            raise AssertionError(f"{placement}: no crash under AC {survivors} (did not reproduce)")
        raise cells[0].exc

    return run


def _fixed(placement: str, device: str) -> None:
    fixes = ["context_fn"]
    if placement in IN_MESH_STEP_PLACEMENTS:  # single-threading helps only there
        fixes.append("single_threaded_backward")
    for fix in fixes:
        for ac in ("selective", "full"):
            cell = run_cell(placement, ac, fix, device)
            if cell.exc is not None:
                raise cell.exc
            where = f"{placement}/{ac}/{fix}/{device}"
            if len(cell.recompute) != N_BLOCKS:
                raise WrongResult(f"{where}: {len(cell.recompute)} blocks recomputed, "
                                  f"expected {N_BLOCKS}")
            if any(c["mesh"] is None for c in cell.recompute):
                raise WrongResult(f"{where}: recompute ran without a mesh: {cell.recompute}")
            if not cell.grads_equal:
                raise WrongResult(f"{where}: gradients differ from the no-AC reference")


_SIGNATURE = (Signature(exception="SpmdTypeError", message="requires an active mesh"),)
# Under fixes.sanitize the first mesh lookup of the recompute (the probe's) already names it.
SANITIZED_SIGNATURES = (
    Signature(exception="MeshLostError", message="during activation-checkpoint recompute"),
)
_UPSTREAM = "verl #6950, torchtitan #3565"

REPROS = [
    Repro(
        forkserver="spmd",  # no megatron-core in its children
        name="mesh-recompute",
        summary="forward inside the spmd mesh, backward outside: checkpoint recompute has no mesh",
        run=_unfixed("main"), signatures=_SIGNATURE, devices=("cpu", "cuda"),
        sanitized_signatures=SANITIZED_SIGNATURES, upstream=_UPSTREAM, timeout=180.0,
    ),
    Repro(
        forkserver="spmd",  # no megatron-core in its children
        name="mesh-recompute-thread",
        summary="backward on another thread than the forward: recompute sees that thread's (no) mesh",
        run=_unfixed("worker"), signatures=_SIGNATURE, devices=("cpu", "cuda"),
        sanitized_signatures=SANITIZED_SIGNATURES, upstream=_UPSTREAM, timeout=180.0,
    ),
    Repro(
        forkserver="spmd",  # no megatron-core in its children
        name="mesh-recompute-device-thread",
        summary="CUDA, multithreading on: recompute runs on the autograd device thread, no mesh",
        run=_unfixed("device-thread"), signatures=_SIGNATURE, devices=("cuda",),
        sanitized_signatures=SANITIZED_SIGNATURES, upstream=_UPSTREAM, timeout=180.0,
    ),
    Repro(
        forkserver="spmd",  # no megatron-core in its children
        name="mesh-recompute-init-thread",
        summary="CUDA, multithreading off at init on main, step on a pool thread: still no mesh",
        run=_unfixed("init-thread"), signatures=_SIGNATURE, devices=("cuda",),
        sanitized_signatures=SANITIZED_SIGNATURES, upstream=_UPSTREAM, timeout=180.0,
    ),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.mesh_recompute")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--matrix", action="store_true",
                        help="run every (placement, AC, fix) cell, one JSON line each")
    args = parser.parse_args(argv)
    if not args.matrix:
        parser.error("nothing to do: pass --matrix (the repros run through python -m repro)")
    for placement in PLACEMENTS:  # on CPU the in-mesh placements are the controls
        for ac in ("selective", "full"):
            for fix in FIXES:
                print("CELL " + run_cell(placement, ac, fix, args.device).as_json(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
