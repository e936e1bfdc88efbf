"""The reclaim in any install order (fixes.megatron.reclaim + fixes.megatron.pristine).

In a verl process verl assigns its own reclaim to megatron-core's ``CheckpointFunction.backward``
inside its Megatron engine's init (``apply_patch_megatron_recomputation_backward``), before or
after anything a user did. Review findings, before this design: with verl's patch there first,
``apply_recompute_reclaim_patch()`` returned True and *wrapped verl's unsafe backward* (the shared
chunk view still crashed); with ours first, verl's assignment replaced it while
``installed_reclaim()`` still said ``alias-aware``. Torch-only cases use PyTorch's reentrant
``CheckpointFunction``; the megatron cases run verl's released patch in a child interpreter.
"""

from __future__ import annotations

import signal
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as tcp

from fixes.megatron import apply_recompute_reclaim_patch, remove_recompute_reclaim_patch
from fixes.megatron.pristine import is_pristine, pristine_backward
from fixes.megatron.reclaim import installed_reclaim, reset_backward
from repro import run_isolated
from repro.verl_release import missing_release

TARGET = tcp.CheckpointFunction
REPO = Path(__file__).parent.parent


def _foreign_backward(ctx, *grads):
    """Someone else's replacement, installed by plain assignment as verl's is."""
    return pristine_backward(TARGET)(ctx, *grads)


@pytest.fixture
def clean_target():
    reset_backward(TARGET)
    yield
    reset_backward(TARGET)


@pytest.mark.cpu
def test_a_foreign_backward_installed_first_is_replaced_not_wrapped(clean_target):
    TARGET.backward = staticmethod(_foreign_backward)
    assert installed_reclaim(TARGET).startswith("foreign:")
    assert "_foreign_backward" in installed_reclaim(TARGET)
    with pytest.warns(RuntimeWarning, match="_foreign_backward"):
        assert apply_recompute_reclaim_patch(TARGET) is True
    assert installed_reclaim(TARGET) == "alias-aware"
    wrapped = TARGET.__dict__["backward"].__func__.__wrapped__
    assert wrapped is not _foreign_backward and is_pristine(TARGET, wrapped)
    assert remove_recompute_reclaim_patch(TARGET) is True
    assert installed_reclaim(TARGET) is None  # the module's own, not the foreign one


@pytest.mark.cpu
def test_a_foreign_backward_installed_after_ours_is_reported_and_replaced_on_the_next_apply(
        clean_target):
    original = TARGET.__dict__["backward"]
    assert apply_recompute_reclaim_patch(TARGET) is True
    TARGET.backward = staticmethod(_foreign_backward)  # verl's engine init, later
    assert installed_reclaim(TARGET).startswith("foreign:")  # the truth, not "alias-aware"
    assert remove_recompute_reclaim_patch(TARGET) is False  # ours is not there: nothing undone
    assert TARGET.__dict__["backward"].__func__ is _foreign_backward
    with pytest.warns(RuntimeWarning, match="_foreign_backward"):
        assert apply_recompute_reclaim_patch(TARGET) is True
    assert TARGET.__dict__["backward"].__func__.__wrapped__ is original.__func__
    assert apply_recompute_reclaim_patch(TARGET) is False  # idempotent


@pytest.mark.cpu
def test_installing_over_the_modules_own_backward_warns_nothing(clean_target):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apply_recompute_reclaim_patch(TARGET) is True


class _NoRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _NoStaticBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2


@pytest.mark.cpu
@pytest.mark.parametrize("cls", [_NoRecompute, _NoStaticBackward], ids=lambda c: c.__name__)
def test_a_backward_of_unknown_shape_is_refused(cls):
    before = cls.__dict__.get("backward")
    with pytest.raises(TypeError, match="not a reentrant checkpoint Function"):
        apply_recompute_reclaim_patch(cls)
    assert cls.__dict__.get("backward") is before


@pytest.mark.cpu
def test_the_recovered_backward_is_the_modules_own_code():
    recovered = pristine_backward(TARGET)
    own = TARGET.__dict__["backward"].__func__
    assert recovered.__code__ == own.__code__ and recovered.__globals__ is own.__globals__
    assert recovered.__qualname__ == own.__qualname__


# --- verl's released patch on megatron-core (CPU; CUDA in the gpu run) -------------------------

DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(version: str) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    why = missing_release(version)
    if why is not None:
        pytest.skip(why)


def _verl_order_child(version: str, device: str, order: str):
    """The shared chunk view on megatron-core with verl ``version``'s released reclaim and ours,
    installed in ``order``; the child prints what is installed, then runs the step."""
    code = textwrap.dedent(f"""
        import warnings
        from megatron.core import tensor_parallel
        from megatron.core.utils import make_viewless_tensor
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from fixes.megatron.reclaim import installed_reclaim
        from repro.shared_view_reclaim import (SharedViewConfig, SharedViewModel,
            install_verl_reclaim, megatron_mtp_checkpoint, setup_megatron, shared_view_step,
            storage_gone)
        import torch
        setup_megatron({device!r})
        for step in {order!r}.split(","):
            if step == "verl":
                install_verl_reclaim({version!r})
            else:
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    applied = apply_recompute_reclaim_patch()
                print("APPLY", applied, "WARNED", [str(m.message).split(" was replaced by ")[1]
                                                   .split(" (")[0] for m in w])
        print("INSTALLED", installed_reclaim(), flush=True)
        torch.manual_seed(0)
        model = SharedViewModel(SharedViewConfig()).to({device!r})
        x = torch.randn(16, 64, device={device!r})
        make_viewless = lambda t: make_viewless_tensor(inp=t, requires_grad=True, keep_graph=True)
        # the MTP checkpoint's form each release's reclaim frees (0.9.1 skips closures over the
        # layer, not megatron-core 0.16.1's bound method): see repro.shared_view_reclaim
        form = "closure" if {version!r} == "0.8.0" else "bound-method"
        with recompute_reclaim_events() as events:
            weak = shared_view_step(model, x, megatron_mtp_checkpoint(form), make_viewless)
            if {device!r} == "cuda":
                torch.cuda.synchronize()
        print("EVENTS", [e.action for e in events], "GONE", storage_gone(weak), flush=True)
    """)
    return run_isolated(code=code, timeout=300, cwd=str(REPO), forkserver=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_verls_released_reclaim_first_then_ours(version, device):
    _need(version)
    r = _verl_order_child(version, device, "verl,ours")
    assert r.ok, r.describe() + "\n" + r.stderr[-3000:]
    # the warning names what was replaced: verl's patch function's inner backward
    assert ("APPLY True WARNED ['verl.models.mcore.patch.apply_patch_megatron_recomputation_"
            "backward.<locals>.patch_backward']") in r.stdout, r.stdout
    assert "INSTALLED alias-aware" in r.stdout, r.stdout
    assert "EVENTS ['detached', 'dropped'] GONE True" in r.stdout, r.stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_ours_first_then_verls_is_reported_and_the_next_apply_replaces_it(version, device):
    _need(version)
    # verl's assignment after ours (its engine init): what is installed is verl's, and it is
    # said so; the crash is verl's own. fixes.verl re-applies ours in verl's patch function.
    crashed = _verl_order_child(version, device, "ours,verl")
    assert "INSTALLED foreign:verl.models.mcore.patch" in crashed.stdout, crashed.stdout
    if device == "cpu":
        assert crashed.signal == signal.SIGSEGV, crashed.describe()
    else:
        assert "an illegal memory access" in crashed.stderr, crashed.stderr[-3000:]
    fixed = _verl_order_child(version, device, "ours,verl,ours")
    assert fixed.ok, fixed.describe() + "\n" + fixed.stderr[-3000:]
    assert "INSTALLED alias-aware" in fixed.stdout, fixed.stdout
    assert "EVENTS ['detached', 'dropped'] GONE True" in fixed.stdout, fixed.stdout
