"""The regression contract, written once and instantiated for every repro and device:
the unfixed path fails with its declared signature, the fixed path completes (and its own
oracle checks the result, e.g. gradients equal to the reference). Repros that declare
``sanitized_signatures`` also run under fixes.sanitize (``python -m repro --sanitize``): the
unfixed path must fail with that named error, the fixed path must still pass (no false
positive). And every fixed path passes under all the sanitizers at once (no false positive of
any of them on any repro)."""

from __future__ import annotations

import dataclasses

import pytest

from repro import discover
from repro.harness.sanitize import NAMES as SANITIZERS
from repro.runner import judge_fixed, judge_unfixed, run_path, skip_reason

REPROS = discover()
CASES = [
    pytest.param(r, device, id=f"{r.name}-{device}",
                 marks=pytest.mark.cpu if device == "cpu" else pytest.mark.gpu)
    for r in REPROS.values()
    for device in r.devices
]
SANITIZED = [case for case in CASES if case.values[0].sanitized_signatures]


def _check_path(repro, device, fixed: bool, sanitized: bool = False,
                sanitizers: tuple[str, ...] | None = None) -> None:
    """Run one path in a child and assert its contract: the unfixed path reproduces one of its
    (sanitized) signatures, the fixed path passes. Skips with the reason when it cannot run:
    known before any child starts (as ``python -m repro`` knows it: a missing package, an unmet
    precondition), or the child's own ``repro.Skipped``."""
    if (reason := skip_reason(repro, device)) is not None:
        pytest.skip(f"{repro.name}: {reason}")
    if sanitizers is not None:
        repro = dataclasses.replace(repro, sanitizers=sanitizers)
    result = run_path(repro, fixed=fixed, device=device, sanitized=sanitized)
    if fixed:
        outcome, expected = judge_fixed(result), "passed"
    else:
        outcome, expected = judge_unfixed(repro, result, device, sanitized=sanitized), "reproduced"
    if outcome.status == "skipped":  # the child raised repro.Skipped: it could not run here
        pytest.skip(outcome.detail)
    assert outcome.status == expected, f"{outcome.detail}\n--- stderr ---\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("repro,device", CASES)
def test_unfixed_path_reproduces_the_crash(repro, device):
    _check_path(repro, device, fixed=False)


@pytest.mark.parametrize("repro,device", CASES)
def test_fixed_path_passes(repro, device):
    _check_path(repro, device, fixed=True)


@pytest.mark.parametrize("repro,device", SANITIZED)
def test_unfixed_path_under_the_sanitizers_names_the_fault(repro, device):
    _check_path(repro, device, fixed=False, sanitized=True)


@pytest.mark.parametrize("repro,device", SANITIZED)
def test_fixed_path_passes_under_the_sanitizers(repro, device):
    _check_path(repro, device, fixed=True, sanitized=True)


@pytest.mark.parametrize("repro,device", CASES)
def test_fixed_path_passes_under_every_sanitizer(repro, device):
    _check_path(repro, device, fixed=True, sanitized=True, sanitizers=SANITIZERS)
