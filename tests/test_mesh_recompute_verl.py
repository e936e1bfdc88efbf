"""repro.mesh_recompute_verl on CPU: the mechanism behind ``mesh-recompute-verl091-init-thread``.

verl 0.9.1's released ``_init_device_mesh`` runs (through ``released_function``) and turns
autograd multithreading off for the thread that called it only. On CPU the step itself cannot
crash (backward runs on the calling thread); the CUDA crash and its fixes are gated by
tests/test_repros.py (marked gpu). Each case runs in a child interpreter: it initialises a
process group and mesh."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from repro import run_isolated
from repro.verl_release import missing_release, release_dir

pytestmark = pytest.mark.cpu
REPO = str(Path(__file__).parent.parent)


@pytest.fixture
def verl091():
    pytest.importorskip("torchtitan.distributed.parallel_dims")
    why = missing_release("0.9.1")
    if why is not None:
        pytest.skip(why)


def _child(code: str):
    return run_isolated(code=textwrap.dedent(code), timeout=240, cwd=REPO, forkserver=True)


def test_verl091_init_turns_multithreading_off_on_its_own_thread_only(verl091):
    r = _child("""
        import threading
        from concurrent.futures import ThreadPoolExecutor
        import torch
        from torchtitan.distributed.parallel_dims import ParallelDims
        from repro.mesh_recompute_verl import init_verl_engine

        def init_here():
            engine = init_verl_engine()
            return engine, torch.autograd.is_multithreading_enabled(), threading.get_ident()

        with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:  # both threads alive
            engine, on_init_thread, init_thread = a.submit(init_here).result()
            again = a.submit(torch.autograd.is_multithreading_enabled).result()
            other = b.submit(lambda: (torch.autograd.is_multithreading_enabled(),
                                      threading.get_ident())).result()
        assert on_init_thread is False and again is False, (on_init_thread, again)
        assert other[1] != init_thread and other[0] is True, other  # another thread: still on
        assert torch.autograd.is_multithreading_enabled()  # main thread untouched
        assert isinstance(engine.parallel_dims, ParallelDims)
        dims = engine.parallel_dims
        assert (dims.tp, dims.dp_shard, dims.world_size) == (1, 1, 1)
        assert engine.device_mesh.mesh_dim_names == ("world",)
        print("VERL-INIT-OK")
    """)
    assert r.ok and "VERL-INIT-OK" in r.stdout, r.stderr[-3000:]


def test_verl091_init_is_the_released_function():
    from repro.mesh_recompute_verl import VERL_INIT, VERL_MODULE, VERL_VERSION
    from repro.verl_release import released_function

    why = missing_release(VERL_VERSION)
    if why is not None:
        pytest.skip(why)
    import torch

    init = released_function(VERL_VERSION, VERL_MODULE, VERL_INIT,
                             {"torch": torch, "ParallelDims": object})
    assert init.__code__.co_filename == str(
        release_dir(VERL_VERSION) / "verl/workers/engine/torchtitan/transformer_impl.py")
    assert "set_multithreading_enabled" in init.__code__.co_names


def test_cpu_step_on_a_pool_thread_has_nothing_to_show(verl091):
    """The control: on CPU the unfixed step passes -- recompute on the step's thread, with the
    mesh, grads equal no AC -- which is why the repro is CUDA only."""
    r = _child("""
        from repro.mesh_recompute_verl import init_verl_engine, reference_grads, run_step
        engine = init_verl_engine()
        reference = reference_grads(engine, "cpu")
        for ac in ("selective", "full"):
            s = run_step(engine, ac, "none", "cpu", reference)
            assert s.exc is None, s.exc
            assert s.init_thread_multithreading is False and s.step_thread_multithreading is True
            assert len(s.recompute) == 2 and s.grads_equal
            assert all(c["thread"] == s.step_thread and c["mesh"] for c in s.recompute)
        print("CPU-CONTROL-OK")
    """)
    assert r.ok and "CPU-CONTROL-OK" in r.stdout, r.stderr[-3000:]


def test_without_the_release_the_repro_is_skipped_naming_the_install(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan.distributed.parallel_dims")
    monkeypatch.setenv("STACKFIX_VERL_ROOT", str(tmp_path))
    from repro import Skipped
    from repro.mesh_recompute_verl import init_verl_engine

    with pytest.raises(Skipped, match="python -m repro.verl_release install"):
        init_verl_engine()
