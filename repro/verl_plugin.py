"""The verl plugin (``fixes.verl``) inside a real ``import verl``: one scenario per crash, each
run as ``python -m repro.verl_plugin SCENARIO`` in a child process (tests/test_verl_plugin.py).

Whether the plugin is loaded is decided the way a verl user decides it, in the environment of
the process before ``import verl``: verl >= 0.9 loads it through our ``verl.plugins`` entry point
unless ``VERL_USE_EXTERNAL_PLUGINS=none``; verl 0.8.0 through ``VERL_USE_EXTERNAL_MODULES=
fixes.verl``. The same scenario, plugin off, is the unfixed path and must reproduce the crash.
Every scenario prints one ``RESULT {json}`` line the test reads.

* ``reclaim`` (crash 2): verl's ``apply_patch_megatron_recomputation_backward()`` called as its
  Megatron engine's ``__init__`` calls it (imported from ``verl.models.mcore.patch`` at call
  time), then ``repro.shared_view_reclaim``'s graph on megatron-core's ``tensor_parallel.
  checkpoint`` with the MTP checkpoint as megatron-core 0.16.1 makes it (a bound method: verl
  0.9.1's MTP skip does not fire). Unfixed: SIGSEGV. Fixed: grads equal a step with megatron's
  own backward, and the storage the leaked recompute graph holds is freed.
* ``reclaim-late``: verl's reclaim installed first (plugin off at ``import verl``), then
  ``import fixes.verl``: ours replaces it, then the same step.
* ``ray``: a Ray actor (local cluster) imports verl and reports what verl's patch function
  installs in that worker.
* ``torchtitan-engine`` (crash 1): verl's released ``TorchTitanEngine._init_device_mesh``,
  served as the class of verl's engine module through the import system (the real module needs
  torchtitan names 0.3.0 lacks: that ImportError is checked first), so the plugin's post-import
  patch applies; then the CPU variant of the crash: forward inside torchtitan's train context
  on a pool thread, backward on the main thread outside it. Unfixed: SpmdTypeError.
* ``mtp-import`` (crash 3, the wiring): ``import verl.models.mcore.mtp_patch``; reports whether
  megatron's ``GPTModel._postprocess`` forwards ``mhc_multistream`` (0.8.0: patched; 0.9.1:
  left alone).
* ``mtp-dev`` (crash 3): verl's ``patch_postprocess(model)`` on Megatron-LM dev's mHC + MTP GPT
  (the checkout ``STACKFIX_MEGATRON_LM`` names; repro/mtp_shape_megatron_dev.py's model and
  checks). Unfixed on verl 0.8.0: ``TypeError: ... unexpected keyword argument 'padding_mask'``.

On CPU megatron-core runs through fixes/testing/megatron_cpu.py's RNG and stream shims.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from repro.harness.leaks import storage_gone

SCENARIOS = ("reclaim", "reclaim-late", "ray", "torchtitan-engine", "mtp-import", "mtp-dev")


def _report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def _plugin_state() -> dict | None:
    plugin = sys.modules.get("fixes.verl")
    state = plugin.status() if plugin is not None else None
    return None if state is None else {"version": state.version, "armed": list(state.armed),
                                       "left_alone": [list(p) for p in state.left_alone]}


def _installed_reclaim() -> str | None:
    from fixes.megatron.reclaim import installed_reclaim

    return installed_reclaim()


# --- crash 2 ------------------------------------------------------------------------------------


@dataclass
class SharedViewCase:
    """The shared-view graph on megatron-core, its no-reclaim reference already taken."""

    device: str
    model: torch.nn.Module
    x: torch.Tensor
    checkpoint: Callable
    make_viewless: Callable
    reference: dict
    leaked_without_reclaim: bool  # megatron's own backward: the leak keeps the storage


def shared_view_case(device: str) -> SharedViewCase:
    """megatron set up on ``device`` (world size 1), the graph built, one step with megatron's
    own backward (no reclaim) for the reference grads. Call before any reclaim is installed."""
    from megatron.core.utils import make_viewless_tensor

    from repro.harness.megatron_world import setup_megatron
    from repro.mtp_checkpoints import megatron_mtp_checkpoint
    from repro.shared_view_reclaim import (
        SharedViewConfig,
        SharedViewModel,
        parameter_grads,
        shared_view_step,
    )

    setup_megatron(device)
    cfg = SharedViewConfig()
    torch.manual_seed(cfg.seed)
    model = SharedViewModel(cfg).to(device)
    x = torch.randn(cfg.seq_len, cfg.hidden, device=device)

    def make_viewless(t):
        return make_viewless_tensor(inp=t, requires_grad=True, keep_graph=True)

    # bound-method: megatron-core 0.16.1's MTP checkpoint; verl 0.9.1's MTP skip misses it
    case = SharedViewCase(device, model, x, megatron_mtp_checkpoint("bound-method"),
                          make_viewless, {}, False)
    ref = shared_view_step(model, x, case.checkpoint, make_viewless)
    case.reference, case.leaked_without_reclaim = parameter_grads(model), not storage_gone(ref)
    model.zero_grad(set_to_none=True)
    model.mtp.leak.clear()
    return case


def shared_view_check(case: SharedViewCase) -> dict:
    """One step with whatever reclaim is installed (unfixed: SIGSEGV on CPU, an illegal memory
    access on CUDA); WrongResult if the grads differ from the reference."""
    from repro.shared_view_reclaim import check_grads_equal, parameter_grads, shared_view_step

    ref = shared_view_step(case.model, case.x, case.checkpoint, case.make_viewless)
    if case.device == "cuda":
        torch.cuda.synchronize()  # an asynchronous CUDA fault surfaces here
    check_grads_equal(parameter_grads(case.model), case.reference)
    return {"grads_equal": True, "leaked_without_reclaim": case.leaked_without_reclaim,
            "freed": storage_gone(ref)}


def _reclaim_scenario(late: bool) -> None:
    import verl  # noqa: F401 - loads the plugin, or not (the environment decides)

    case = shared_view_case("cpu")
    # As verl's Megatron engine __init__ does it, at call time from the module.
    from verl.models.mcore.patch import apply_patch_megatron_recomputation_backward

    apply_patch_megatron_recomputation_backward()
    before_plugin = _installed_reclaim()
    if late:
        import fixes.verl  # noqa: F401 - the plugin loaded after verl's reclaim went in
    installed = _installed_reclaim()
    print(f"reclaim installed: {installed!r} (before a late plugin: {before_plugin!r})",
          flush=True)
    got = shared_view_check(case)  # unfixed: SIGSEGV here
    _report(installed=installed, before_plugin=before_plugin, plugin=_plugin_state(), **got)


# --- Ray ----------------------------------------------------------------------------------------


RAY_TMPDIR_ROOM = 107 - 66  # the longest RAY_TMPDIR whose socket paths fit AF_UNIX


def _ray_scenario() -> None:
    import ray

    @ray.remote(num_cpus=1)
    class VerlWorker:
        def report(self) -> dict:
            import os

            import verl
            from verl.models.mcore import patch

            from repro.verl_plugin import _installed_reclaim, _plugin_state

            patch.apply_patch_megatron_recomputation_backward()  # what verl's engine does
            return {"pid": os.getpid(), "verl": verl.__version__, "plugin": _plugin_state(),
                    "installed": _installed_reclaim()}

    # Ray's sockets lie 66 bytes below its temp dir ("ray/session_<date>_<time>_<pid>/sockets/
    # plasma_store") and an AF_UNIX path ends at 107 bytes, so a temp dir of a deep checkout
    # (tox's) fails ray.init; nor may it be inside the virtualenv (tox's TMPDIR is). A short
    # one of its own under /tmp then.
    given, own = os.environ.get("RAY_TMPDIR"), None
    if not given or len(given) > RAY_TMPDIR_ROOM:
        own = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="sf-ray-", dir="/tmp")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        worker = VerlWorker.remote()
        got = ray.get(worker.report.remote(), timeout=180)
    finally:
        ray.shutdown()
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
    got["driver_pid"] = os.getpid()
    _report(**got)


# --- crash 1 ------------------------------------------------------------------------------------

ENGINE_MODULE = "verl.workers.engine.torchtitan.transformer_impl"


class _ReleasedEngineModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``ENGINE_MODULE`` as a module holding ``TorchTitanEngine`` (and its LM-head
    subclass, a bare subclass here) with verl's released ``_init_device_mesh`` (``repro.verl_release.released_function``: its bytes, compiled), for
    the one import after it is installed."""

    def __init__(self, version: str):
        self.version = version

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from torchtitan.distributed.parallel_dims import ParallelDims

        from repro.verl_release import released_function

        init = released_function(self.version, ENGINE_MODULE, "TorchTitanEngine._init_device_mesh",
                                 {"torch": torch, "ParallelDims": ParallelDims})
        module.TorchTitanEngine = type("TorchTitanEngine", (), {
            "__module__": ENGINE_MODULE, "_init_device_mesh": init})
        # the engine package's __init__ imports both names
        module.TorchTitanEngineWithLMHead = type("TorchTitanEngineWithLMHead",
                                                 (module.TorchTitanEngine,),
                                                 {"__module__": ENGINE_MODULE})


def _ac_model(probe, ac: str) -> torch.nn.Module:
    """repro.mesh_recompute's typed blocks, each wrapped as torchtitan's FullAC / SelectiveAC
    ``apply`` wraps a layer: a non-reentrant ``CheckpointWrapper`` (none: no AC)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from repro.mesh_recompute import N_BLOCKS, SEED, TypedBlock, torchtitan_style_policy

    torch.manual_seed(SEED)
    blocks = [TypedBlock(probe) for _ in range(N_BLOCKS)]
    if ac == "selective":
        ctx = functools.partial(create_selective_checkpoint_contexts, torchtitan_style_policy())
        blocks = [checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     context_fn=ctx) for b in blocks]
    elif ac == "full":
        blocks = [checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                  for b in blocks]
    return torch.nn.Sequential(*blocks)


def _engine_step(engine_cls: type, ac: str) -> dict:
    """verl's engine init on the main thread; the step's forward inside torchtitan's train
    context on a pool thread; its backward on the main thread, outside the context."""
    from torchtitan.distributed import utils as dist_utils

    from repro.mesh_recompute import DIM, TOKENS, Probe
    from repro.mesh_recompute_verl import EngineSizes

    probe = Probe()
    engine = engine_cls.__new__(engine_cls)
    engine.engine_config = EngineSizes()
    engine.trainer = SimpleNamespace(model_parts=[_ac_model(probe, ac)])
    engine._init_device_mesh()  # verl's, on the main thread (then ours, if patched)
    dist_utils.set_spmd_backend(engine.parallel_dims.spmd_backend)  # as Trainer.__init__
    train_context = dist_utils.get_spmd_context(parallel_dims=engine.parallel_dims)

    reference_model = _ac_model(Probe(), "none")
    torch.manual_seed(1)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    with train_context():
        reference_model(x).pow(2).sum().backward()
    reference = [p.grad.clone() for p in reference_model.parameters()] + [x.grad.clone()]
    x.grad = None

    model = engine.trainer.model_parts[0]

    def forward():
        with train_context():
            return model(x).pow(2).sum()

    with ThreadPoolExecutor(1) as pool:
        loss = pool.submit(forward).result()
    probe.phase = "backward"
    loss.backward()  # unfixed: SpmdTypeError in the recompute
    grads = [p.grad for p in model.parameters()] + [x.grad]
    recomputed = [c for c in probe.calls if c["phase"] == "backward"]
    return {
        "grads_equal": all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True)),
        "recomputed_with_mesh": [c["mesh"] is not None for c in recomputed],
        "recompute_thread_is_main": [c["thread"] == threading.main_thread().ident
                                     for c in recomputed],
    }


def _torchtitan_engine_scenario() -> None:
    import verl

    from repro.harness.spmd_mesh import ensure_fake_backend, ensure_process_group

    try:
        __import__(ENGINE_MODULE)
        real_import = "imported"
    except ImportError as exc:  # torchtitan 0.3.0: no torchtitan.components.lr_scheduler
        real_import = f"{type(exc).__name__}: {exc}"
    print(f"verl {verl.__version__}'s {ENGINE_MODULE}: {real_import}", flush=True)
    if real_import == "imported":
        engine_cls = sys.modules[ENGINE_MODULE].TorchTitanEngine  # pragma: no cover
    else:
        sys.meta_path.insert(1, _ReleasedEngineModule(verl.__version__))
        engine_cls = __import__(ENGINE_MODULE, fromlist=["TorchTitanEngine"]).TorchTitanEngine
    patched = getattr(engine_cls._init_device_mesh, "_stackfix_mesh_preserving_ac", False)

    ensure_process_group()
    ensure_fake_backend()
    results = {ac: _engine_step(engine_cls, ac) for ac in ("selective", "full")}
    _report(real_import=real_import, patched=patched, plugin=_plugin_state(), results=results)


# --- crash 3 ------------------------------------------------------------------------------------


def _mtp_import_scenario() -> None:
    import verl  # noqa: F401
    import verl.models.mcore.mtp_patch as mtp_patch

    from fixes.megatron.mtp_postprocess import is_mtp_postprocess_patched

    _report(forwards=is_mtp_postprocess_patched(mtp_patch.GPTModel), plugin=_plugin_state())


def _mtp_dev_scenario() -> None:
    """verl's ``patch_postprocess(model)`` (real ``import verl``) on Megatron-LM dev's mHC + MTP
    GPT (``STACKFIX_MEGATRON_LM``), checked as repro.mtp_shape_megatron_dev checks it: the MTP
    depth reads the decoder's streams, MTP loss and grads equal dev's own postprocess."""
    from repro.mtp_shape_megatron_dev import (
        DevMTPConfig,
        build_dev_gpt,
        check_matches_reference,
        check_reads_the_streams,
        make_batch,
        setup_dev_megatron,
        train_step,
    )

    cfg = DevMTPConfig()
    setup_dev_megatron("cpu")  # the dev checkout first on sys.path, before verl imports megatron
    import verl  # noqa: F401 - loads the plugin, or not

    model = build_dev_gpt(cfg, "cpu")
    batch = make_batch(cfg, "cpu")
    reference = train_step(model, batch)  # dev's own postprocess, nothing of verl imported yet
    from verl.models.mcore import mtp_patch  # the plugin's hook patches GPTModel here

    mtp_patch.patch_postprocess(model)  # as verl's Megatron engine does per model
    got = train_step(model, batch)  # verl 0.8.0 unfixed: TypeError (padding_mask)
    check_reads_the_streams(got, cfg)
    check_matches_reference(got, reference, cfg)
    _report(depth_input=list(got.depth_input.shape), mtp_grads=len(got.mtp_grads),
            plugin=_plugin_state())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.verl_plugin")
    parser.add_argument("scenario", choices=SCENARIOS)
    args = parser.parse_args(argv)
    if args.scenario in ("reclaim", "reclaim-late"):
        _reclaim_scenario(late=args.scenario == "reclaim-late")
    elif args.scenario == "ray":
        _ray_scenario()
    elif args.scenario == "torchtitan-engine":
        _torchtitan_engine_scenario()
    elif args.scenario == "mtp-import":
        _mtp_import_scenario()
    else:
        _mtp_dev_scenario()
    return 0


if __name__ == "__main__":
    sys.exit(main())
