"""``fixes.megatron.apply_output_discard_patch`` on megatron-core's real ``CheckpointWithoutOutput``:
which outputs the discard frees, that values and gradients are megatron's, and install / undo.
The crash itself (unfixed: SIGSEGV / illegal memory access) runs in a child through
tests/test_repros.py (repros ``shared-output-discard``, ``shared-output-discard-class``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fixes.megatron import (
    apply_output_discard_patch,
    installed_output_discard,
    kept_outputs,
    remove_output_discard_patch,
)

mrandom = pytest.importorskip("megatron.core.tensor_parallel.random",
                              reason="megatron-core not installed")


@pytest.fixture
def megatron_checkpoint():
    """megatron's CheckpointWithoutOutput runnable here (CPU shims; FP8 off without TE), with the
    patch installed for the test and removed after."""
    from fixes.testing import megatron_on_cpu
    from fixes.testing.megatron_cpu import bind_missing_te_fp8_state

    with megatron_on_cpu():
        bind_missing_te_fp8_state()
        apply_output_discard_patch()
        try:
            yield mrandom.CheckpointWithoutOutput
        finally:
            remove_output_discard_patch()


def _residual_norm(weight):
    def norm(x):  # TEFusedResidualRMSNorm's contract: (normed, the input itself)
        return F.rms_norm(x, x.shape[-1:], weight), x
    return norm


def _step(checkpoint_cls, x, weight, proj, checkpointed=True):
    inp = x.clone().requires_grad_(True)
    h = inp * 2.0
    if checkpointed:
        ckpt = checkpoint_cls()
        normed, residual = ckpt.checkpoint(_residual_norm(weight), h)
    else:
        ckpt, (normed, residual) = None, _residual_norm(weight)(h)
    y = proj(normed.view(-1, x.shape[-1]))  # the reader saves a *view* of the output
    if ckpt is not None:
        ckpt.discard_output_and_register_recompute(y)
    sizes = [o.untyped_storage().nbytes() for o in ckpt.outputs] if ckpt else []
    kept = kept_outputs(ckpt) if ckpt else ()
    out = y.view_as(residual) + residual
    out.backward(torch.ones_like(out))
    return out.detach(), inp.grad, sizes, kept


@pytest.mark.cpu
def test_keeps_the_residual_frees_the_normed_output_and_matches_no_checkpoint(megatron_checkpoint):
    torch.manual_seed(0)
    x, weight = torch.randn(8, 2, 16), nn.Parameter(torch.rand(16) + 0.5)
    proj = nn.Linear(16, 16)
    ref_out, ref_grad, _, _ = _step(megatron_checkpoint, x, weight, proj, checkpointed=False)
    ref_w, ref_p = weight.grad.clone(), proj.weight.grad.clone()
    weight.grad = proj.weight.grad = proj.bias.grad = None
    out, grad, sizes, kept = _step(megatron_checkpoint, x, weight, proj)
    assert kept == (False, True)
    # the normed output freed although its reader saved a view of it; the residual kept
    assert sizes[0] == 0 and sizes[1] == x.numel() * x.element_size()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(weight.grad, ref_w)
    torch.testing.assert_close(proj.weight.grad, ref_p)


@pytest.mark.cpu
def test_keeps_an_output_on_a_parameters_storage(megatron_checkpoint):
    """Not only inputs: any tensor sharing the output's storage when it is made keeps it."""
    table = nn.Parameter(torch.randn(4, 8))
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = megatron_checkpoint()
    scaled, row = ckpt.checkpoint(lambda t: (t * 3.0, table[0]), x)
    y = (scaled * row).sum()
    ckpt.discard_output_and_register_recompute(y)
    assert kept_outputs(ckpt) == (False, True)
    assert scaled.untyped_storage().nbytes() == 0
    assert table.untyped_storage().nbytes() == table.numel() * 4  # megatron's own frees it
    assert torch.isfinite(table).all()


@pytest.mark.cpu
def test_released_class_frees_the_shared_output():
    """What the patch changes: without it megatron frees the residual (the input's storage)."""
    from fixes.testing import megatron_on_cpu
    from fixes.testing.megatron_cpu import bind_missing_te_fp8_state

    with megatron_on_cpu():
        bind_missing_te_fp8_state()
        remove_output_discard_patch()
        h = torch.randn(4, 8, requires_grad=True) * 1.0
        ckpt = mrandom.CheckpointWithoutOutput()
        normed, residual = ckpt.checkpoint(_residual_norm(torch.ones(8)), h)
        ckpt.discard_output_and_register_recompute(normed.sum())
        assert h.untyped_storage().nbytes() == 0  # the input's memory went with the residual
        assert kept_outputs(ckpt) == ()


@pytest.mark.cpu
def test_apply_is_idempotent_and_remove_restores_megatrons_own():
    cls = mrandom.CheckpointWithoutOutput
    before = {n: vars(cls)[n] for n in vars(cls) if callable(vars(cls)[n])}
    share = vars(mrandom).get("_get_share_storage")
    try:
        assert not installed_output_discard()
        assert apply_output_discard_patch() is True
        assert apply_output_discard_patch() is False
        assert installed_output_discard()
        assert vars(cls)["checkpoint"].__wrapped__ is before["checkpoint"]
        if share is not None:  # megatron-core >= 0.19: the recompute's share_storage guarded
            assert mrandom._get_share_storage is not share
        assert remove_output_discard_patch() is True
        assert remove_output_discard_patch() is False
    finally:
        remove_output_discard_patch()
    assert {n: vars(cls)[n] for n in vars(cls) if callable(vars(cls)[n])} == before
    assert vars(mrandom).get("_get_share_storage") is share


@pytest.mark.cpu
def test_the_layer_repro_is_na_where_megatron_keeps_a_declared_residual():
    """Megatron-LM main (#4497) passes ``retain_input_tensors=True`` where a norm declares
    ``returns_residual`` (the repro's norm does, as TE's does): the layer's crash is fixed there,
    and the layer repro says n/a naming why; a release's class (no such parameter) runs it."""
    from dataclasses import dataclass

    from repro.shared_output_discard import ResidualRMSNorm, why_not_applicable

    @dataclass
    class Config:  # a release with the (output, residual) norm path (0.17+)
        fused_residual_rmsnorm: bool = False

    @dataclass
    class OldConfig:  # 0.16.1: no such path
        normalization: str = "RMSNorm"

    class Released:  # 0.16.1 - 0.19.2: frees every output
        def __init__(self, fp8=False, ckpt_manager=None):
            pass

    class Main:  # Megatron-LM main 19deef67+
        def __init__(self, fp8=False, ckpt_manager=None, retain_input_tensors=False):
            pass

    assert ResidualRMSNorm.returns_residual is True
    assert why_not_applicable("0.19.2", Config, Released) is None
    assert "#4497" in why_not_applicable("0.20.0", Config, Main)
    assert why_not_applicable("0.20.0", Config, Main).startswith("n/a on megatron-core 0.20.0:")
    assert "no (output, residual) norm path" in why_not_applicable("0.16.1", OldConfig, Released)
    # the installed megatron-core's real classes take one of these answers
    from megatron.core.transformer.transformer_config import TransformerConfig

    real = why_not_applicable("installed", TransformerConfig, mrandom.CheckpointWithoutOutput)
    assert real is None or real.startswith("n/a on megatron-core installed:")
