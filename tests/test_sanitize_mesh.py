"""``fixes.sanitize.mesh_sanitizer``: forward code that finds no spmd mesh during checkpoint
recompute, or a torchtitan redistribution run with none during backward, raises MeshLostError;
what it wraps is put back. Nothing here frees memory, so it runs in-process (the TP=2 repros
check it across ranks)."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from pathlib import Path

import pytest
import spmd_types as spmd
import torch
from torch.utils.checkpoint import checkpoint

from fixes.sanitize import MeshLostError, mesh_sanitizer
from fixes.torchtitan import mesh_preserving_context_fn
from repro import run_isolated
from repro.harness.optional import require
from repro.harness.spmd_mesh import spmd_mesh

ROOT = str(Path(__file__).parent.parent)
# These tests enter the sanitizers themselves (they refuse to be nested).
pytestmark = pytest.mark.no_stackfix_sanitize
LOOKUPS = ("current_mesh", "current_mesh_names", "current_mesh_all_names")


@pytest.fixture(scope="module")
def mesh():
    return spmd_mesh()


def _mesh_dependent(x):
    """Forward code that branches on the mesh, as torchtitan's redistribution does."""
    if spmd.current_mesh() is None:
        return x.sin()
    return x.sin() * 1.0


class MegatronStyleCheckpointFunction(torch.autograd.Function):
    """A reentrant checkpoint of the shape of megatron-core's CheckpointFunction: the forward
    runs without grad, the backward replays it and backpropagates through the replay."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        with torch.no_grad():
            return _mesh_dependent(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = _mesh_dependent(x)
        torch.autograd.backward(out, grad)
        return x.grad


def _checkpointed(kind: str, x):
    if kind == "reentrant":
        return checkpoint(_mesh_dependent, x, use_reentrant=True)
    if kind == "megatron-style":
        return MegatronStyleCheckpointFunction.apply(x)
    context_fn = mesh_preserving_context_fn if kind == "mesh_preserving" else None
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(_mesh_dependent, x, use_reentrant=False, **kwargs)


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant", "megatron-style"])
def test_lookup_in_recompute_outside_the_mesh_raises(kind, mesh):
    x = torch.randn(4, requires_grad=True)
    with mesh_sanitizer() as s:
        with spmd.set_current_mesh(mesh):
            loss = _checkpointed(kind, x).sum()
        assert s.mesh_seen
        with pytest.raises(MeshLostError, match=r"spmd_types\.current_mesh\(\) found no current "
                           r"spmd mesh during activation-checkpoint recompute") as info:
            loss.backward()
    assert info.value.op == "spmd_types.current_mesh"
    assert info.value.site[0].startswith("tests/test_sanitize_mesh.py:")
    assert info.value.site[0].endswith("in _mesh_dependent")
    assert "mesh_preserving_context_fn" in str(info.value)


@pytest.mark.cpu
def test_recompute_on_another_thread_raises_there(mesh):
    x = torch.randn(4, requires_grad=True)
    errors = []

    def backward(loss):
        try:
            loss.backward()
        except MeshLostError as e:
            errors.append(e)

    with mesh_sanitizer():
        with spmd.set_current_mesh(mesh):
            loss = _checkpointed("non-reentrant", x).sum()
        t = threading.Thread(target=backward, args=(loss,), name="backward-thread")
        t.start(); t.join()  # noqa: E702
    assert len(errors) == 1 and "[thread backward-thread]" in str(errors[0])


@pytest.mark.cpu
def test_no_error_where_the_mesh_is_kept_or_was_never_there(mesh):
    with mesh_sanitizer() as s:
        # Never saw a mesh: nothing was lost (forward and recompute agree).
        x = torch.randn(4, requires_grad=True)
        _checkpointed("non-reentrant", x).sum().backward()
        assert not s.mesh_seen
        # Backward inside the mesh, and the mesh-preserving fix with backward outside it.
        for kind, backward_in_mesh in (("non-reentrant", True), ("mesh_preserving", False)):
            with spmd.set_current_mesh(mesh):
                loss = _checkpointed(kind, torch.randn(4, requires_grad=True)).sum()
                if backward_in_mesh:
                    loss.backward()
            if not backward_in_mesh:
                loss.backward()
        # A backward hook asking for the mesh is not forward code being recomputed.
        y = torch.randn(4, requires_grad=True)
        with spmd.set_current_mesh(mesh):
            z = y * 2
        seen = []
        z.register_hook(lambda g: seen.append(spmd.current_mesh()))
        z.sum().backward()
        assert seen == [None] and s.mesh_seen
        assert spmd.current_mesh() is None  # and outside backward


class _SavesTheReplayingThreadsMesh:
    """A recompute context that saves the replaying thread's mesh with a public lookup (as
    torch_remat's recompute state hooks do) before the replay: state, not forward code."""

    def __init__(self, seen):
        self.seen = seen

    def __enter__(self):
        self.seen.append(spmd.current_mesh())

    def __exit__(self, *exc):
        self.seen.append(spmd.current_mesh())


@pytest.mark.cpu
def test_a_lookup_entering_the_recompute_context_is_not_forward_code(mesh):
    seen = []
    context_fn = lambda: (contextlib.nullcontext(), _SavesTheReplayingThreadsMesh(seen))  # noqa: E731
    x = torch.randn(4, requires_grad=True)
    with mesh_sanitizer():
        with spmd.set_current_mesh(mesh):
            loss = checkpoint(torch.sin, x, use_reentrant=False, context_fn=context_fn).sum()
        loss.backward()  # the replayed torch.sin looks nothing up
    assert seen == [None, None]


@pytest.mark.cpu
def test_wraps_every_namespace_and_restores_them(monkeypatch):
    from spmd_types import _state, runtime

    by_name = types.ModuleType("stackfix_test_by_name")
    by_name.current_mesh = spmd.current_mesh  # `from spmd_types import current_mesh`
    monkeypatch.setitem(sys.modules, by_name.__name__, by_name)
    originals = {name: getattr(_state, name) for name in LOOKUPS}
    with pytest.raises(ValueError, match="boom"), mesh_sanitizer() as s:
        for name in LOOKUPS:
            assert getattr(spmd, name) is not originals[name]
            assert f"spmd_types.{name}" in s.wrapped
        assert by_name.current_mesh is spmd.current_mesh
        # spmd_types' own modules keep theirs (its type checker is not forward code of ours).
        assert runtime.current_mesh is originals["current_mesh"]
        raise ValueError("boom")
    for name in LOOKUPS:
        assert getattr(spmd, name) is originals[name]
    assert by_name.current_mesh is originals["current_mesh"]


@pytest.mark.cpu
def test_a_wrapper_left_behind_passes_through(mesh):
    with mesh_sanitizer():
        stale = spmd.current_mesh
        with spmd.set_current_mesh(mesh):
            stale()  # seen
    x = torch.randn(4, requires_grad=True)
    with spmd.set_current_mesh(mesh):
        loss = checkpoint(lambda t: t.sin() if stale() is None else t.cos(), x,
                          use_reentrant=False).sum()
    loss.backward()  # no sanitizer active: the stale wrapper only forwards the call
    with mesh_sanitizer():  # a new one wraps the original again, not the stale wrapper
        assert spmd.current_mesh.__stackfix_mesh_sanitizer_wraps__ is not stale


@pytest.mark.cpu
def test_nesting_is_refused():
    with mesh_sanitizer():
        with pytest.raises(RuntimeError, match=r"mesh_sanitizer\(\) is already active"):
            with mesh_sanitizer():
                pass


@pytest.mark.cpu
def test_without_spmd_types_entering_names_it_and_importing_does_not_fail():
    code = (
        "import sys\nsys.modules['spmd_types'] = None\n"
        "import fixes.sanitize as f\n"
        "try:\n    f.mesh_sanitizer().__enter__()\n"
        "except ModuleNotFoundError as e:\n    print('NAME', e.name); print('MSG', e)\n"
    )
    result = run_isolated(code=code, timeout=120, cwd=ROOT)
    assert result.ok, result.stderr[-3000:]
    assert "NAME spmd_types" in result.stdout
    assert "mesh_sanitizer() needs spmd_types (pip install spmd-types" in result.stdout


# --- torchtitan's seam: spmd_redistribute_per_axis ---------------------------------------------


def _titan():
    titan_spmd, titan_module, parallel_dims = require(
        "torchtitan.distributed.spmd_types", "torchtitan.protocols.module",
        "torchtitan.distributed.parallel_dims")
    return titan_spmd, titan_module, parallel_dims.MeshAxisName


@pytest.mark.cpu
def test_torchtitan_redistribution_without_a_mesh_in_backward_raises(mesh):
    titan_spmd, titan_module, axis = _titan()
    original = titan_spmd.spmd_redistribute_per_axis
    tp = axis.TP
    with mesh_sanitizer() as s:
        wrapped = titan_spmd.spmd_redistribute_per_axis
        assert wrapped is not original and titan_module.spmd_redistribute_per_axis is wrapped
        assert "torchtitan.distributed.spmd_types.spmd_redistribute_per_axis" in s.wrapped
        x = torch.randn(2, 3, requires_grad=True)
        wrapped(x, mesh, {tp: spmd.I}, {tp: spmd.R})  # a forward with its mesh (size-1 axis)
        assert s.mesh_seen
        assert wrapped(x, None, {tp: spmd.P}, {tp: spmd.I}) is x  # outside backward: no error

        y = x * 2
        y.register_hook(lambda g: wrapped(g, None, {tp: spmd.I}, {tp: spmd.I}))  # no change
        y.register_hook(lambda g: wrapped(g, None, {tp: spmd.P}, {tp: spmd.I}))
        with pytest.raises(MeshLostError, match=r"spmd_redistribute_per_axis ran during backward "
                           r"with no current spmd mesh .* \{tp: P -> I\}") as info:
            y.sum().backward()
        assert info.value.op == "spmd_redistribute_per_axis"
        assert "(shape [2, 3])" in str(info.value)
    assert titan_spmd.spmd_redistribute_per_axis is original
    assert titan_module.spmd_redistribute_per_axis is original


@pytest.mark.cpu
def test_torchtitan_imported_while_active_is_wrapped_then_restored():
    code = (
        "import sys, importlib.util\n"
        "from fixes.sanitize import mesh_sanitizer\n"
        "if importlib.util.find_spec('torchtitan') is None:\n    print('NO-TORCHTITAN'); sys.exit()\n"
        "assert 'torchtitan.distributed.spmd_types' not in sys.modules\n"
        "hooks = len(sys.meta_path)\n"
        "with mesh_sanitizer() as s:\n"
        "    import torchtitan.protocols.module as m\n"
        "    import torchtitan.distributed.spmd_types as t\n"
        "    print('WRAPPED', m.spmd_redistribute_per_axis is t.spmd_redistribute_per_axis,"
        " hasattr(t.spmd_redistribute_per_axis, '__stackfix_mesh_sanitizer_wraps__'), s.wrapped[-1])\n"
        "print('RESTORED', m.spmd_redistribute_per_axis is t.spmd_redistribute_per_axis,"
        " hasattr(t.spmd_redistribute_per_axis, '__stackfix_mesh_sanitizer_wraps__'),"
        " len(sys.meta_path) == hooks)\n"
    )
    result = run_isolated(code=code, timeout=240, cwd=ROOT)
    assert result.ok, result.stderr[-3000:]
    if "NO-TORCHTITAN" in result.stdout:
        pytest.skip("torchtitan is not installed")
    assert "WRAPPED True True torchtitan.distributed.spmd_types.spmd_redistribute_per_axis " \
        "(on import)" in result.stdout
    assert "RESTORED True False True" in result.stdout


@pytest.mark.gpu
def test_recompute_on_a_cuda_device_thread_raises(mesh):
    """CUDA backward runs the recompute on autograd's device thread: no mesh there, and the
    sanitizer's lookup sees the checkpoint frames on that thread's stack."""
    x = torch.randn(4, device="cuda", requires_grad=True)
    with mesh_sanitizer():
        with spmd.set_current_mesh(mesh):
            loss = _checkpointed("non-reentrant", x).sum()
            with pytest.raises(MeshLostError, match="during activation-checkpoint recompute") \
                    as info:
                loss.backward()  # inside the mesh, but not on the thread that recomputes
    assert "[thread MainThread]" not in str(info.value)
