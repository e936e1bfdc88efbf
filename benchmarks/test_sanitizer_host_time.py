"""``benchmarks.sanitizer_host_time``: every stage it names is reached by a real region (a
renamed function must fail here, not read as zero), its wrappers come off, and its usage
errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from benchmarks import sanitizer_host_time as sht

pytestmark = pytest.mark.cpu


def _step():
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    for layer in layers:  # small state: the snapshot copies its bits
        layer.register_buffer("scale", torch.full((16,), 0.5))
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        h = x
        for layer in layers:
            h = checkpoint(lambda t, m=layer: torch.tanh(m(t)) * m.scale, h,
                           use_reentrant=True)
        h.sum().backward()

    return step


def test_each_stage_is_timed_in_every_region_of_each_mode():
    out = sht.host_time(_step(), steps=2, rounds=2)
    assert set(out) == set(sht.VALUES)
    for figures in out.values():
        assert figures["regions_per_step"] == 3
        assert set(figures["us_per_region_by_stage"]) == set(sht.STAGES)
        assert all(us > 0 for us in figures["us_per_region_by_stage"].values())
        assert len(figures["us_per_region_repeats"]) == 2
        assert figures["us_per_region"] > 0


def test_the_wrappers_come_off():
    before = {stage: owner.__dict__[name] for stage, (owner, name) in sht._stages().items()}
    seconds, calls = dict.fromkeys(sht.STAGES, 0.0), dict.fromkeys(sht.STAGES, 0)
    with sht.timed_stages(seconds, calls):
        assert all(owner.__dict__[name] is not before[stage]
                   for stage, (owner, name) in sht._stages().items())
    assert all(owner.__dict__[name] is before[stage]
               for stage, (owner, name) in sht._stages().items())


def test_a_step_without_regions_is_an_error_not_zero():
    with pytest.raises(ValueError, match="ran no checkpointed region"):
        sht.host_time(lambda: torch.randn(2, requires_grad=True).sum().backward(), steps=1,
                      rounds=1)


@pytest.mark.parametrize("argv,message", [
    ([], "give at least one --cell"),
    (["--cell", "moe:128x8:fp32:0:full", "--values", "some"], "allowed: all, sampled, none"),
    (["--cell", "moe:128x8:fp32:0:full", "--steps", "0"], "--steps and --rounds must be >= 1"),
    (["--cell", "moe:128:fp32:0:full"], "expected MODEL:SIZE:DTYPE:AUX:RECOMPUTE"),
    (["--cell", "moe:128x8:fp32:0:full", "--layers", "4,0"], "positive integers"),
])
def test_bad_arguments_name_what_is_allowed(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        sht.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
