"""The reclaim in any install order (fixes.megatron.reclaim + fixes.megatron.pristine).

In a verl process verl assigns its own reclaim to megatron-core's ``CheckpointFunction.backward``
inside its Megatron engine's init (``apply_patch_megatron_recomputation_backward``), before or
after anything a user did. Review findings, before this design: with verl's patch there first,
``apply_recompute_reclaim_patch()`` returned True and *wrapped verl's unsafe backward* (the shared
chunk view still crashed); with ours first, verl's assignment replaced it while
``installed_reclaim()`` still named ours, and later nothing said so at all. Torch-only cases use PyTorch's reentrant
``CheckpointFunction``; the megatron cases run verl's released patch in a child interpreter.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as tcp
from verl_megatron import DEVICES, need_verl_on_megatron

from fixes.megatron import (
    apply_recompute_reclaim_patch,
    pristine,
    remove_recompute_reclaim_patch,
)
from fixes.megatron.pristine import is_own_backward, own_backward
from fixes.megatron.reclaim import PATCH_KIND, installed_reclaim, reset_backward
from repro import run_isolated

TARGET = tcp.CheckpointFunction
REPO = Path(__file__).parent.parent


def _foreign_backward(ctx, *grads):
    """Someone else's replacement, installed by plain assignment as verl's is."""
    return own_backward(TARGET).__func__(ctx, *grads)


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
    assert installed_reclaim(TARGET) == PATCH_KIND
    wrapped = TARGET.__dict__["backward"].__func__.__wrapped__
    assert wrapped is not _foreign_backward and is_own_backward(TARGET, wrapped)
    assert remove_recompute_reclaim_patch(TARGET) is True
    assert installed_reclaim(TARGET) is None  # the module's own, not the foreign one


@pytest.mark.cpu
def test_a_foreign_backward_installed_after_ours_is_reported_and_replaced_on_the_next_apply(
        clean_target):
    original = TARGET.__dict__["backward"]
    assert apply_recompute_reclaim_patch(TARGET) is True
    TARGET.backward = staticmethod(_foreign_backward)  # verl's engine init, later
    assert installed_reclaim(TARGET).startswith("foreign:")  # the truth, not ours
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


_RECOVERED_IS_OWN = """
import torch.utils.checkpoint as tcp
from fixes.megatron.pristine import recover_from_source
recovered = recover_from_source(tcp.CheckpointFunction)
own = tcp.CheckpointFunction.__dict__["backward"].__func__
assert recovered.__code__ == own.__code__ and recovered.__globals__ is own.__globals__
assert recovered.__qualname__ == own.__qualname__
print("RECOVERED-OWN")
"""


@pytest.mark.cpu
def test_the_recovered_backward_is_the_modules_own_code():
    # recover_from_source refuses a source file written less than _CLOCK_SLACK_S before its
    # process began (the process may not have imported what is on disk now). In an env made
    # moments before this worker started (uv writes torch's files as it installs) that is
    # this process: then a process begun after them, as every later one in that env is.
    started, written = pristine._process_started_at(), os.stat(tcp.__file__).st_mtime
    if started is not None and written <= started - pristine._CLOCK_SLACK_S:
        exec(_RECOVERED_IS_OWN, {})
        return
    time.sleep(max(0.0, written + pristine._CLOCK_SLACK_S + 0.5 - time.time()))
    r = run_isolated(code=_RECOVERED_IS_OWN, cwd=str(REPO), timeout=120)
    assert r.ok and "RECOVERED-OWN" in r.stdout, r.stderr[-3000:]


# --- verl's released patch on megatron-core (CPU; CUDA in the gpu run) -------------------------

_need = need_verl_on_megatron


def _verl_order_child(version: str, device: str, order: str):
    """The shared chunk view on megatron-core with verl ``version``'s released reclaim and ours,
    installed in ``order``; the child prints what is installed, then runs the step."""
    code = textwrap.dedent(f"""
        import warnings
        from megatron.core import tensor_parallel
        from megatron.core.utils import make_viewless_tensor
        from fixes.megatron import apply_recompute_reclaim_patch, recompute_reclaim_events
        from fixes.megatron.reclaim import installed_reclaim
        from repro.harness.leaks import storage_gone
        from repro.harness.megatron_world import setup_megatron
        from repro.mtp_checkpoints import megatron_mtp_checkpoint
        from repro.reclaims import install_verl_reclaim
        from repro.shared_view_reclaim import SharedViewConfig, SharedViewModel, shared_view_step
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
        print("EVENTS", [e.action.value for e in events], "GONE", storage_gone(weak), flush=True)
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
    assert f"INSTALLED {PATCH_KIND}" in r.stdout, r.stdout
    assert "EVENTS ['released'] GONE True" in r.stdout, r.stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_ours_first_then_verls_is_reported_and_the_next_apply_replaces_it(version, device):
    _need(version)
    # verl's assignment after ours (its engine init): what is installed is verl's, and it is
    # said so; the crash is verl's own. fixes.verl re-applies ours in verl's patch function.
    crashed = _verl_order_child(version, device, "ours,verl")
    assert "INSTALLED foreign:verl.models.mcore.patch" in crashed.stdout, crashed.stdout
    # named at the first checkpoint call after the assignment, before verl's backward runs
    assert (f"after stackfix's {PATCH_KIND} reclaim was installed" in crashed.stderr
            and "verl.models.mcore.patch" in crashed.stderr), crashed.stderr[-3000:]
    if device == "cpu":
        assert crashed.signal == signal.SIGSEGV, crashed.describe()
    else:
        assert "an illegal memory access" in crashed.stderr, crashed.stderr[-3000:]
    fixed = _verl_order_child(version, device, "ours,verl,ours")
    assert fixed.ok, fixed.describe() + "\n" + fixed.stderr[-3000:]
    assert f"INSTALLED {PATCH_KIND}" in fixed.stdout, fixed.stdout
    assert "EVENTS ['released'] GONE True" in fixed.stdout, fixed.stdout


# --- the backward is the one the process imported ---------------------------------------------

_MODULE = '''
import torch


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, flag, x):
        ctx.run_function = run_function
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        copy = x.detach()
        copy.requires_grad = x.requires_grad
        with torch.enable_grad():
            out = ctx.run_function(copy)
        torch.autograd.backward(out, grad)
        return None, None, copy.grad
'''


def _edited_on_disk_child(foreign_first: bool, edit: bool) -> str:
    """A reentrant checkpoint module written, dated before this process and imported; then
    (``foreign_first``) a foreign backward assigned over its own, (``edit``) its file edited on
    disk so that its backward doubles every gradient, a line further down (a ``git pull``
    while the job runs); then ``apply_recompute_reclaim_patch``. Prints what happened and the grad."""
    return textwrap.dedent(f"""
        import os, sys, tempfile, time, warnings
        import torch
        from fixes.megatron import apply_recompute_reclaim_patch
        from fixes.megatron.reclaim import installed_reclaim
        d = tempfile.mkdtemp()
        path = os.path.join(d, "ckmod.py")
        with open(path, "w") as f:
            f.write({_MODULE!r})
        past = time.time() - 3600
        os.utime(path, (past, past))  # a file older than the process, as an installed one is
        sys.path.insert(0, d)
        import ckmod
        if {foreign_first}:
            own = ckmod.Checkpoint.backward
            ckmod.Checkpoint.backward = staticmethod(lambda ctx, *g: own(ctx, *g))
        if {edit}:
            src = "# pulled\\n" + open(path).read().replace("copy.grad", "copy.grad * 2")
            with open(path, "w") as f:
                f.write(src)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                print("APPLY", apply_recompute_reclaim_patch(ckmod.Checkpoint))
            except RuntimeError as e:
                print("REFUSED", e)
        print("WARNED", [str(m.message) for m in w])
        print("INSTALLED", installed_reclaim(ckmod.Checkpoint))
        x = torch.ones(3, requires_grad=True)
        ckmod.Checkpoint.apply(lambda t: t * 3, False, x).sum().backward()
        print("GRAD", x.grad.tolist())
    """)


def _run_edited(foreign_first: bool, edit: bool) -> str:
    r = run_isolated(code=_edited_on_disk_child(foreign_first, edit), timeout=120,
                     cwd=str(REPO), forkserver=True)
    assert r.ok, r.describe() + "\n" + r.stderr[-3000:]
    return r.stdout


@pytest.mark.cpu
def test_an_edited_file_never_changes_the_backward_that_is_wrapped():
    # Before: the module's own backward was reported foreign ("X was replaced by X") and the
    # edited body (every gradient doubled) was compiled from disk and installed, silently.
    out = _run_edited(foreign_first=False, edit=True)
    assert "APPLY True" in out and "WARNED []" in out, out
    assert "INSTALLED foreign" not in out and "INSTALLED None" not in out, out
    assert "GRAD [3.0, 3.0, 3.0]" in out, out  # the body the process imported


@pytest.mark.cpu
def test_recovering_the_own_backward_from_an_edited_file_is_refused():
    out = _run_edited(foreign_first=True, edit=True)
    assert "REFUSED" in out and "changed on disk" in out, out
    assert "INSTALLED foreign:" in out, out  # nothing was installed
    assert "GRAD [3.0, 3.0, 3.0]" in out, out


@pytest.mark.cpu
def test_the_own_backward_is_recovered_from_a_file_older_than_the_process():
    out = _run_edited(foreign_first=True, edit=False)
    assert "APPLY True" in out and "GRAD [3.0, 3.0, 3.0]" in out, out
    assert "INSTALLED foreign" not in out, out


# --- a reclaim assigned over ours is named at the next checkpoint call ------------------------


@pytest.mark.cpu
def test_a_backward_assigned_over_ours_is_named_at_the_next_checkpoint_call(clean_target):
    # Before: nothing said so; verl's reclaim then freed the shared chunk view (rc 139).
    assert apply_recompute_reclaim_patch(TARGET) is True
    TARGET.backward = staticmethod(_foreign_backward)  # verl's engine init, later
    x = torch.ones(3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"replaced.*_foreign_backward"):
        tcp.checkpoint(lambda t: t * 2, x, use_reentrant=True).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not at every call
        tcp.checkpoint(lambda t: t * 2, x, use_reentrant=True).sum().backward()
    assert installed_reclaim(TARGET).startswith("foreign:")
    assert "_foreign_backward" in installed_reclaim(TARGET)
