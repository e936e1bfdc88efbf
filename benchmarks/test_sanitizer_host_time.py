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
    for v, figures in out.items():
        assert figures["regions_per_step"] == 3
        assert set(figures["us_per_region_by_stage"]) == set(sht.STAGES)
        # sampled and none take the modules a region's identity ran from its last record
        timed = {s for s, us in figures["us_per_region_by_stage"].items() if us > 0}
        assert timed == (set(sht.STAGES) if v == "all" else set(sht.STAGES) - {"ran"}), v
        assert len(figures["us_per_region_repeats"]) == 2
        assert figures["us_per_region"] > 0
        # every identity's record (and in all, its plan) kept from the entering step
        assert figures["recorded_per_region"] == 0, v


class _Keeping(torch.nn.Linear):
    """Keeps its last output as a plain attribute, rebound every forward (the old one freed,
    the module scanned again: megatron's token dispatcher)."""

    def forward(self, t):
        out = torch.tanh(super().forward(t))
        self.last = out.detach()
        return out


def _rebinding_step():
    layers = [_Keeping(16, 16) for _ in range(3)]
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        h = x
        for layer in layers:
            h = checkpoint(lambda t, m=layer: m(t), h, use_reentrant=True)
        h.sum().backward()

    return step


def test_split_times_each_part_beside_the_stages_and_leaves_the_totals_theirs():
    """``--split``: each part's figure where its mode ran it, None where it did not (every
    mode: the identity and its plan, no walk of the function's roots once the plan is made;
    all alone: the modules' attributes checked once a round), the stages and their total as
    without it."""
    out = sht.host_time(_rebinding_step(), steps=2, rounds=1, split=sht.PARTS)
    parts = {f"{s}.{p}" for s, ps in sht._parts().items() for p in ps}
    always = {"site.call_site", "site.watch", "reach.read", "reach.rescan", "reach.sort",
              "judge.shape", "judge.settle", "judge.defer"}
    for v, figures in out.items():
        assert set(figures["us_per_region_by_part"]) == parts
        assert set(figures["us_per_region_by_stage"]) == set(sht.STAGES)
        assert figures["us_per_region"] == pytest.approx(
            sum(figures["us_per_region_by_stage"].values()))
        ran = {p for p, us in figures["us_per_region_by_part"].items() if us is not None}
        assert always | {"reach.plan", "site.identity"} <= ran, v
        assert not ran & {"reach.roots", "reach.narrow"}, v
        assert ("reach.check" in ran) == (v == "all"), v


def test_a_regions_call_site_is_its_callers_not_the_timers():
    """The timer wraps ``region`` and ``call_site``: the site the sanitizer records must still
    be the line that checkpoints (the wrapper's line made every region one site)."""
    from fixes.sanitize import recompute_sanitizer

    table = sht._table(sht.PARTS)
    seconds, calls = dict.fromkeys(table, 0.0), dict.fromkeys(table, 0)
    with recompute_sanitizer(values="none") as sanitizer, \
            sht.timed_stages(seconds, calls, sht.PARTS):
        _step()()
    assert calls["site"] == calls["site.call_site"] == 3
    assert [site[0].split(" in ")[0] for site in sanitizer._sites] == [
        "benchmarks/test_sanitizer_host_time.py:25"]


def test_a_function_not_found_leaves_none_wrapped(monkeypatch):
    """A stage's function missing (renamed) is a KeyError before anything is wrapped: no
    stage found before it stays timed for the rest of the process."""
    table = sht._table()
    before = {stage: owner.__dict__[name] for stage, (owner, name) in table.items()}
    owner = table["site"][0]
    monkeypatch.setattr(sht, "_table", lambda split=(): {**table, "gone": (owner, "gone")})
    with pytest.raises(KeyError, match="gone"):
        with sht.timed_stages(dict.fromkeys(table, 0.0), dict.fromkeys(table, 0)):
            pass
    assert all(owner.__dict__[name] is before[stage] for stage, (owner, name) in table.items())


def test_the_wrappers_come_off():
    table = sht._table(sht.PARTS)
    before = {stage: owner.__dict__[name] for stage, (owner, name) in table.items()}
    seconds, calls = dict.fromkeys(table, 0.0), dict.fromkeys(table, 0)
    with sht.timed_stages(seconds, calls, sht.PARTS):
        assert all(owner.__dict__[name] is not before[stage]
                   for stage, (owner, name) in table.items())
    assert all(owner.__dict__[name] is before[stage] for stage, (owner, name) in table.items())


def test_the_modes_that_record_no_module_run_are_timed_alone():
    """sampled and none take a region's modules from its identity's last record: timed
    without ``all``, their ``ran`` reads 0 (no error: the stage is all's)."""
    out = sht.host_time(_step(), values=("sampled", "none"), steps=2, rounds=1)
    assert [out[v]["us_per_region_by_stage"]["ran"] for v in ("sampled", "none")] == [0, 0]


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
    (["--cell", "moe:128x8:fp32:0:full", "--split", "reach,nope"], "allowed: site, reach, judge"),
])
def test_bad_arguments_name_what_is_allowed(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        sht.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
