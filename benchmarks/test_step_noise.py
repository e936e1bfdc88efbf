"""``benchmarks.step_noise``: its summary of per-step times, and its usage errors."""

from __future__ import annotations

import pytest

from benchmarks import step_noise

pytestmark = pytest.mark.cpu


def _steps(walls):
    return [{"wall_s": w, "cpu_s": w / 2, "involuntary": 0, "voluntary": 1, "gc_s": 0.0,
             "gc_collections": 0, "device_allocs": 0} for w in walls]


def test_a_drift_reads_as_a_high_lag_one_autocorrelation_and_jitter_as_a_low_one():
    drift = step_noise.summary(_steps([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]))
    jitter = step_noise.summary(_steps([1.0, 1.2, 1.0, 1.2, 1.0, 1.2, 1.0, 1.2]))
    assert drift["lag1"] > 0.5
    assert jitter["lag1"] < -0.5
    assert drift["median_s"] == pytest.approx(1.35)
    assert drift["cpu_over_wall"] == pytest.approx(0.5)
    assert drift["steps"] == 8


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--variants", "bogus"], "allowed: consecutive, rounds, gc-off, pinned, toggled"),
    (["--values", "some"], "allowed: all, sampled, none"),
    (["--kernels"], "it needs --device cuda and the toggled variant"),
])
def test_bad_arguments_name_what_is_allowed(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        step_noise.main(["--cell", "moe:128x8:fp32:0:full", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
