"""Which modules a checkpointed region's forward ran (``fixes.sanitize._ran``): recorded by a
global forward pre-hook held only while a recording is open."""

from __future__ import annotations

import threading

import pytest
import torch

from fixes.sanitize._ran import ModulesRun

pytestmark = pytest.mark.cpu


def _hooks() -> int:
    return len(torch.nn.modules.module._global_forward_pre_hooks)


def _block():
    block = torch.nn.Module()
    block.layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(3))
    return block


def test_a_recording_holds_each_module_called_once_first_call_first():
    block, run = _block(), ModulesRun()
    x = torch.randn(2, 4)
    before = _hooks()
    with run.recording() as ran:
        assert _hooks() == before + 1
        block.layers[1](x)
        block.layers[1][0](x)  # again: recorded once
        block.layers[0](x)
    assert _hooks() == before  # the hook goes with the last recording
    layer1, layer0 = block.layers[1], block.layers[0]
    assert [id(m) for m in ran] == list(map(id, [layer1, layer1[0], layer1[1], layer0,
                                                 layer0[0], layer0[1]]))
    block.layers[2](x)  # no recording open: not recorded anywhere
    assert len(ran) == 6 and run._local.calls is None


def test_nested_recordings_each_hold_their_own_calls_and_the_outer_the_inners():
    block, run = _block(), ModulesRun()
    x = torch.randn(2, 4)
    with run.recording() as outer:
        block.layers[0](x)
        with run.recording() as inner:
            block.layers[1](x)
        assert _hooks() >= 1  # the outer one still records
        block.layers[2](x)
    assert {id(m) for m in inner} == {id(m) for m in block.layers[1].modules()}
    assert {id(m) for m in outer} == {id(m) for m in block.layers.modules()} - {
        id(block.layers)}


def test_the_hook_goes_when_the_forward_raises():
    run, before = ModulesRun(), _hooks()

    class Failing(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("the region's own failure")

    with pytest.raises(RuntimeError, match="own failure"), run.recording():
        Failing()(torch.ones(1))
    assert _hooks() == before and run._local.calls is None


def test_each_thread_records_its_own_calls():
    """A call another thread makes while a region's forward runs is no module the region ran:
    taken for one, it narrowed a root the region reads without calling any of its modules
    (reached whole) to the other thread's module (a review of cb82629). A thread with its own
    recording open records its own calls."""
    run, lin, other = ModulesRun(), torch.nn.Linear(2, 2), torch.nn.Tanh()
    got = {}

    def in_a_region_of_its_own():
        with run.recording() as theirs:
            other(torch.ones(2))
        got["theirs"] = theirs

    with run.recording() as ran:
        t = threading.Thread(target=lin, args=(torch.ones(2),))
        t.start()
        t.join()
        t = threading.Thread(target=in_a_region_of_its_own)
        t.start()
        t.join()
        lin(torch.ones(2))
    assert [id(m) for m in ran] == [id(lin)]
    assert [id(m) for m in got["theirs"]] == [id(other)]


def test_close_removes_the_hook_under_an_open_recording_whose_end_then_does_nothing():
    run, before = ModulesRun(), _hooks()
    left_open = run.recording()
    left_open.__enter__()
    run.close()
    assert _hooks() == before
    with run.recording() as ran:  # a new one records as usual
        torch.nn.Identity()(torch.ones(1))
        left_open.__exit__(None, None, None)  # the old one's end removes nothing of it
        assert _hooks() == before + 1
        torch.nn.Tanh()(torch.ones(1))
    assert [type(m).__name__ for m in ran] == ["Identity", "Tanh"] and _hooks() == before


def test_the_sanitizers_exit_removes_the_hook_of_a_region_left_suspended():
    """A non-reentrant region's forward is the time its checkpoint generator is suspended at
    its yield; one held suspended past the sanitizer's exit (code that drives torch's
    generator itself and never resumes it) takes no hook with it, and its late close
    removes nothing."""
    import torch.utils.checkpoint as torch_checkpoint

    from fixes.sanitize import recompute_sanitizer

    before, lin = _hooks(), torch.nn.Linear(2, 2)
    with recompute_sanitizer(values="none"):
        gen = torch_checkpoint._checkpoint_without_reentrant_generator(lin)
        next(gen)  # the region's forward begins
        assert _hooks() == before + 1
    assert _hooks() == before
    gen.close()
    assert _hooks() == before
