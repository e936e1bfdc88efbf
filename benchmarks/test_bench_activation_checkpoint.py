"""Activation checkpointing: bytes and recompute FLOPs of none / selective / full AC, each with
and without the mesh-preserving context_fn (benchmarks/_ac.py has the models), plus the
relations that must hold between them."""

from __future__ import annotations

import pytest
import torch

from benchmarks import _ac
from benchmarks._bench import DEVICE_PARAMS, record, timed, untimed
from benchmarks._measure import backward_flops, measure_memory

SCENARIO = "activation-checkpoint/{}"
CASES = {case.strategy: case for case in _ac.CASES}


def _skip_unless_buildable(model: str) -> None:
    if model == "llama3-debugmodel":
        reason = _ac.torchtitan_unavailable()
        if reason:
            pytest.skip(reason)


def ac_figures(model: str, case: _ac.ACCase, device: str, run=untimed) -> dict:
    setup = _ac.build(model, case, torch.device(device))
    run(setup.step)  # warm-up (timed when benchmarked): lazily built state stays out of the figures
    figures = measure_memory(setup.forward, backward=setup.backward, device=device,
                             track=setup.track).as_extra_info()
    figures["backward_flops"] = backward_flops(setup.forward, setup.backward)
    setup.model.zero_grad(set_to_none=True)
    return figures


def book_figures(book, model: str, strategy: str, device: str) -> dict:
    return book.get(("ac", model, strategy, device),
                    lambda: ac_figures(model, CASES[strategy], device))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("strategy", tuple(CASES))
@pytest.mark.parametrize("model", _ac.MODELS)
def test_activation_checkpoint_memory(benchmark, figure_book, model, strategy, device):
    _skip_unless_buildable(model)
    figures = ac_figures(model, CASES[strategy], device, run=timed(benchmark, device))
    figure_book.put(("ac", model, strategy, device), figures)
    reference = book_figures(figure_book, model, "none", device)
    # Recompute FLOPs: what this backward does beyond the backward without AC.
    figures = dict(figures, recompute_flops=figures["backward_flops"] - reference["backward_flops"])
    record(benchmark, scenario=SCENARIO.format(model), strategy=strategy, device=device,
           figures=figures)


# --- the relations the strategies must keep -------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("ac", ("selective", "full"))
@pytest.mark.parametrize("model", _ac.MODELS)
def test_mesh_preserving_context_fn_costs_nothing(figure_book, model, ac, device):
    """Identical bytes and recompute FLOPs with and without the mesh-preserving context_fn:
    it re-enters a mesh, it changes no dispatch and keeps nothing alive."""
    _skip_unless_buildable(model)
    plain = book_figures(figure_book, model, ac, device)
    with_mesh = book_figures(figure_book, model, f"{ac}+mesh_ctx", device)
    assert with_mesh == plain


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("model", _ac.MODELS)
def test_checkpointing_trades_flops_for_memory(figure_book, model, device):
    """Less kept for backward, more recomputed in it: none > selective > full in bytes after
    forward, none < selective < full in backward FLOPs."""
    _skip_unless_buildable(model)
    none, selective, full = (book_figures(figure_book, model, s, device)
                             for s in ("none", "selective", "full"))
    assert none["after_forward_bytes"] > selective["after_forward_bytes"] > full["after_forward_bytes"]
    assert none["backward_flops"] < selective["backward_flops"] < full["backward_flops"]
    assert none["end_of_backward_bytes"] == selective["end_of_backward_bytes"] == full["end_of_backward_bytes"]
