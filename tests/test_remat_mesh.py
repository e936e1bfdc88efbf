"""Crash 1 under torch_remat (fixes/torchtitan/remat_mesh.py): the replay sees the forward's
mesh on any thread, the caller's mesh state is put back, user hooks still run, and an installed
torch_remat without ``recompute_state_hooks`` is refused by name. The unfixed crash itself is
the ``mesh-recompute-remat`` repro (tests/test_repros.py runs it in a child process)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import spmd_types as spmd
import torch

from fixes.torchtitan import (
    MeshRecomputeStateHook,
    RematUnsupported,
    mesh_preserving_context_fn,
    mesh_preserving_remat_checkpoint,
)
from repro.harness.spmd_mesh import spmd_mesh

remat = pytest.importorskip("torch_remat", reason="torch-remat not installed (extra: remat)")
pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def mesh():
    return spmd_mesh()


def _names():
    names = spmd.current_mesh_all_names()
    return None if names is None else sorted(names)


def _recorder(log):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)

    def fn(x):
        log.append((threading.get_ident(), _names()))
        return torch.tanh(x @ w)

    return fn, w


def test_torch_remat_takes_no_context_fn():
    # Why mesh_preserving_context_fn cannot be used with it (torch-remat 0.2.2).
    with pytest.raises(TypeError, match="context_fn"):
        remat.checkpoint(region_name="b", context_fn=mesh_preserving_context_fn)


def test_hook_snapshot_installs_on_another_thread_and_restores(mesh):
    hook = MeshRecomputeStateHook()
    with spmd.set_current_mesh(mesh):
        snapshot = hook.snapshot()

    def elsewhere():
        mine = hook.snapshot()
        hook.restore(snapshot)
        inside = _names()
        hook.restore(mine)
        return inside, _names()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(elsewhere).result() == (["tp"], None)


@pytest.mark.parametrize("where", ["main", "worker"])
def test_replay_sees_the_forward_mesh_and_grads_match(mesh, where):
    log = []
    fn, w = _recorder(log)
    x = torch.randn(4, 16)
    reference = torch.autograd.grad(fn(x).sum(), w)[0]
    log.clear()
    with spmd.set_current_mesh(mesh):
        loss = mesh_preserving_remat_checkpoint(region_name="r")(fn)(x).sum()
    if where == "main":
        loss.backward()
    else:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(loss.backward).result()
    assert [m for _, m in log] == [["tp"], ["tp"]]  # forward, then the replay
    assert (log[1][0] == threading.get_ident()) == (where == "main")
    assert _names() is None  # the caller's (empty) mesh state is back
    assert torch.equal(w.grad, reference)


def test_caller_mesh_is_back_after_the_replay(mesh):
    other = spmd_mesh("dp")
    log = []
    fn, _ = _recorder(log)
    with spmd.set_current_mesh(mesh):
        loss = mesh_preserving_remat_checkpoint(region_name="r")(fn)(torch.randn(4, 16)).sum()
    with spmd.set_current_mesh(other):
        loss.backward()
        assert _names() == ["dp"]
    assert [m for _, m in log] == [["tp"], ["tp"]]


def test_user_recompute_state_hooks_still_run(mesh):
    class Counter:
        def __init__(self):
            self.value, self.restored = 0, []

        def snapshot(self):
            return self.value

        def restore(self, state):
            self.restored.append(state)
            self.value = state

    counter, log = Counter(), []
    fn, _ = _recorder(log)
    with spmd.set_current_mesh(mesh):
        loss = mesh_preserving_remat_checkpoint(region_name="r", recompute_state_hooks=(counter,))(
            fn)(torch.randn(4, 16)).sum()
    counter.value = 7
    loss.backward()
    assert counter.restored == [0, 7]  # realigned for the replay, the caller's value put back
    assert [m for _, m in log] == [["tp"], ["tp"]]


def test_a_torch_remat_without_state_hooks_is_refused_by_version(monkeypatch):
    def checkpoint(*, region_name=None, determinism_check="none"):
        raise AssertionError("not to be called")

    monkeypatch.setattr(remat, "checkpoint", checkpoint)
    with pytest.raises(RematUnsupported, match=r"torch_remat \d+\.\d+\.\d+.*recompute_state_hooks"):
        mesh_preserving_remat_checkpoint(region_name="r")
