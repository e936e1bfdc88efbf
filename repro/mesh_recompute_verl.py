"""Crash 1 on verl 0.9.1's torchtitan engine: its init-time fix misses a step on another thread.

verl 0.9.1 (``verl/workers/engine/torchtitan/transformer_impl.py``, after verl #6950):
``TorchTitanEngine._init_device_mesh`` builds torchtitan's ``ParallelDims`` mesh and then calls
``torch.autograd.set_multithreading_enabled(False)`` once, so that activation-checkpoint
recompute runs on the thread that holds the spmd mesh; ``forward_backward_batch`` runs the
forward *and* ``loss.backward()`` inside ``self.trainer.train_context()`` (torchtitan's
``get_spmd_context``: the thread-local spmd mesh). That setting is thread-local too. A worker
whose training step runs on another thread than its init -- a thread-pool actor -- still
backpropagates CUDA tensors on autograd's device thread, where no mesh is set:

- main thread: verl 0.9.1's released ``_init_device_mesh``, run as released on an engine
  object holding only its ``engine_config`` sizes (world size 1, tp=1), and torchtitan's
  train context built from the ``ParallelDims`` it made (as ``Trainer`` builds it);
- a ``ThreadPoolExecutor`` thread: the step, as ``forward_backward_batch`` does it -- forward
  and backward inside the train context -- on ``repro.mesh_recompute``'s two-block model
  (``spmd_types.assert_type(h, R)`` under torchtitan-style selective AC and under full AC).

Unfixed: ``SpmdTypeError: ... requires an active mesh`` from the recompute. Fixed, on the same
threads after the same init: ``fixes.torchtitan.mesh_preserving_context_fn`` on the checkpoint
(recompute stays on the device thread and sees the forward's mesh), or
``fixes.torchtitan.single_threaded_backward()`` around each step (recompute on the step's
thread); gradients equal the no-AC reference. CUDA only: on CPU backward runs on the calling
thread, so the init-time setting is never needed and there is nothing to show.

verl's module itself does not import here (torchtitan 0.3.0 has no
``torchtitan.components.lr_scheduler``; ``torchtitan.train`` does not import on torch 2.11), so
only ``_init_device_mesh`` is taken from the release (``repro.verl_release.released_function``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from repro.mesh_recompute import N_BLOCKS, SANITIZED_SIGNATURES, Probe, build_model, grads_of
from repro.registry import Repro, Signature, Skipped, WrongResult
from repro.verl_release import released_function

VERL_VERSION = "0.9.1"
VERL_MODULE = "verl.workers.engine.torchtitan.transformer_impl"
VERL_INIT = "TorchTitanEngine._init_device_mesh"
FIXES = ("none", "context_fn", "single_threaded_backward")


@dataclass(frozen=True)
class EngineSizes:
    """The ``engine_config`` fields verl's ``_init_device_mesh`` reads: one rank, no parallelism."""

    data_parallel_shard_size: int = 1
    data_parallel_replicate_size: int = 1
    context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1


def _torchtitan():
    """torchtitan's ParallelDims and the module holding its train (spmd) context."""
    try:
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError as exc:  # verl's init and train context need these two, nothing else
        raise Skipped(f"torchtitan's ParallelDims / train context do not import: {exc!r}") from exc
    return ParallelDims, dist_utils


def init_verl_engine(version: str = VERL_VERSION) -> SimpleNamespace:
    """An engine object after verl ``version``'s released ``_init_device_mesh`` ran on the calling
    thread, with ``train_context`` as torchtitan's ``Trainer`` builds it from that ParallelDims.
    ``VerlUnavailable`` (a Skipped) if the release is not installed."""
    from repro.harness.spmd_mesh import ensure_fake_backend, ensure_process_group

    ParallelDims, dist_utils = _torchtitan()
    init = released_function(version, VERL_MODULE, VERL_INIT,
                             {"torch": torch, "ParallelDims": ParallelDims})
    ensure_process_group()
    ensure_fake_backend()
    engine = SimpleNamespace(engine_config=EngineSizes())
    init(engine)
    dist_utils.set_spmd_backend(engine.parallel_dims.spmd_backend)  # Trainer.__init__ does this
    engine.train_context = dist_utils.get_spmd_context(parallel_dims=engine.parallel_dims)
    return engine


@dataclass
class Step:
    """One training step on a pool thread after verl's init on the main thread."""

    ac: str
    fix: str
    init_thread_multithreading: bool | None = None
    step_thread: int | None = None
    step_thread_multithreading: bool | None = None
    recompute: list = field(default_factory=list)
    grads_equal: bool | None = None
    exc: BaseException | None = None


def run_step(engine, ac: str, fix: str, device: str, reference) -> Step:
    """verl's forward_backward_batch shape -- forward and backward inside the train context --
    on a ThreadPoolExecutor thread; ``fix`` adds ours on that same thread."""
    from fixes.torchtitan import single_threaded_backward

    if fix not in FIXES:
        raise ValueError(f"fix must be one of {FIXES}, got {fix!r}")
    probe = Probe()
    model, x = build_model(ac, "context_fn" if fix == "context_fn" else "none", device, probe)
    step = Step(ac, fix, init_thread_multithreading=torch.autograd.is_multithreading_enabled())

    def train_step():
        per_step = single_threaded_backward() if fix == "single_threaded_backward" \
            else contextlib.nullcontext()
        with per_step, engine.train_context():
            step.step_thread = threading.get_ident()
            step.step_thread_multithreading = torch.autograd.is_multithreading_enabled()
            loss = model(x)
            probe.phase = "backward"
            loss.backward()

    with ThreadPoolExecutor(1) as pool:
        try:
            pool.submit(train_step).result()
        except Exception as exc:  # noqa: BLE001 - kept on the Step, re-raised by the repro
            step.exc = exc
    step.recompute = [c for c in probe.calls if c["phase"] == "backward"]
    if step.exc is None:
        step.grads_equal = all(torch.equal(a, b) for a, b in
                               zip(grads_of(model, x), reference, strict=True))
    return step


def reference_grads(engine, device: str):
    """No activation checkpointing (nothing recomputed), inside the same train context."""
    model, x = build_model("none", "none", device, Probe())
    with engine.train_context():
        model(x).backward()
    return grads_of(model, x)


def _check_init_mechanism(step: Step) -> None:
    """verl's line ran (main thread single-threaded) and did not reach the pool thread."""
    if step.init_thread_multithreading is not False:
        raise AssertionError(f"verl {VERL_VERSION}'s {VERL_INIT} left autograd multithreading "
                             "on for its own thread: not the release under test")
    if step.step_thread_multithreading is not True and step.fix != "single_threaded_backward":
        raise AssertionError("the pool thread had multithreading off without our fix")


def run(fixed: bool, device: str) -> None:
    if device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("mesh-recompute-verl091-init-thread needs CUDA: on CPU backward runs "
                           "on the calling thread and the init-time setting is never needed")
    engine = init_verl_engine()
    reference = reference_grads(engine, device)
    if not fixed:
        steps = [run_step(engine, ac, "none", device, reference) for ac in ("selective", "full")]
        for step in steps:
            _check_init_mechanism(step)
        survivors = [s.ac for s in steps if s.exc is None]
        if survivors:
            raise AssertionError(f"no crash under AC {survivors} (did not reproduce)")
        for s in steps:
            print(f"unfixed {s.ac}: step thread {s.step_thread}, recompute on "
                  f"{[c['thread'] for c in s.recompute]} with mesh "
                  f"{[c['mesh'] for c in s.recompute]}", file=sys.stderr)
        raise steps[0].exc
    for fix in FIXES[1:]:
        for ac in ("selective", "full"):
            step = run_step(engine, ac, fix, device, reference)
            where = f"verl {VERL_VERSION} init, step on a pool thread, {ac} AC, {fix}"
            if step.exc is not None:
                raise step.exc
            _check_init_mechanism(step)
            if len(step.recompute) != N_BLOCKS:
                raise WrongResult(f"{where}: {len(step.recompute)} blocks recomputed, "
                                  f"expected {N_BLOCKS}")
            if any(c["mesh"] is None for c in step.recompute):
                raise WrongResult(f"{where}: recompute ran without a mesh: {step.recompute}")
            threads = {c["thread"] for c in step.recompute}
            # The mechanism: single-threaded keeps recompute on the step's thread; the
            # context_fn fixes it where it runs (autograd's device thread).
            on_step_thread = threads == {step.step_thread}
            if on_step_thread != (fix == "single_threaded_backward"):
                raise WrongResult(f"{where}: recompute threads {threads}, step thread "
                                  f"{step.step_thread}")
            if not step.grads_equal:
                raise WrongResult(f"{where}: gradients differ from the no-AC reference")
            print(f"fixed {ac}/{fix}: recompute on {sorted(threads)}, step thread "
                  f"{step.step_thread}, grads equal the reference", file=sys.stderr)


REPROS = [
    Repro(
        name="mesh-recompute-verl091-init-thread",
        summary="verl 0.9.1's engine init turns autograd multithreading off on its thread only; a "
                "CUDA step on a pool thread recomputes on the device thread without the mesh "
                "(CUDA only: on CPU backward stays on the calling thread)",
        run=run, devices=("cuda",),
        # spmd_types 0.2.3: "assert_type(...) requires an active mesh, but no current mesh is
        # set"; 0.3.1: "A bare ... requires an active mesh ..." -- the common fragment.
        signatures=(Signature(exception="SpmdTypeError", message="requires an active mesh"),),
        # Under fixes.sanitize: named at the recompute's first mesh lookup (the probe's).
        sanitized_signatures=SANITIZED_SIGNATURES,
        requires=("spmd_types", "torchtitan"),
        upstream="verl #6950, torchtitan #3565", timeout=300.0,
    ),
]
