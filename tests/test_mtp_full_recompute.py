"""``fixes.megatron.apply_mtp_recompute_patch``: megatron-core 0.18.x's MTP full recompute takes the
``padding_mask`` its forward passes (verl #7326, Megatron-LM #4933). The crash (unfixed: TypeError)
runs in a child through tests/test_repros.py (repro ``mtp-full-recompute``, skipped where the
installed megatron-core is not affected; the compat matrix runs it on 0.18.2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fixes.megatron import (
    MTPRecomputeRefused,
    apply_mtp_recompute_patch,
    mtp_recompute_needs_patch,
    remove_mtp_recompute_patch,
)
from fixes.megatron.mtp_recompute import AFFECTED_RELEASES


class _Release018:
    """The two signatures the patch reads, as megatron-core 0.18.2 has them."""

    def forward(self, input_ids, hidden_states, padding_mask=None):
        return self._checkpointed_forward(hidden_states, padding_mask=padding_mask)

    def _checkpointed_forward(self, hidden_states, attention_mask=None):
        return hidden_states * 2


class _Release019(_Release018):
    def _checkpointed_forward(self, hidden_states, attention_mask=None, padding_mask=None):
        return hidden_states * 2


@pytest.mark.cpu
def test_takes_padding_mask_none_refuses_a_tensor_and_undo_restores():
    own = _Release018.__dict__["_checkpointed_forward"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'padding_mask'"):
        _Release018().forward(None, torch.ones(2))
    try:
        assert mtp_recompute_needs_patch(_Release018)
        assert apply_mtp_recompute_patch(_Release018) is True
        assert apply_mtp_recompute_patch(_Release018) is False
        assert torch.equal(_Release018().forward(None, torch.ones(2)), torch.full((2,), 2.0))
        with pytest.raises(MTPRecomputeRefused, match="0.18.0 / 0.18.2") as refused:
            _Release018().forward(None, torch.ones(2), padding_mask=torch.zeros(2, dtype=torch.bool))
        assert "0.17.1 or 0.19.x" in str(refused.value)
    finally:
        assert remove_mtp_recompute_patch(_Release018) is True
    assert _Release018.__dict__["_checkpointed_forward"] is own
    assert remove_mtp_recompute_patch(_Release018) is False


@pytest.mark.cpu
def test_a_release_that_takes_padding_mask_is_left_alone():
    assert not mtp_recompute_needs_patch(_Release019)
    assert apply_mtp_recompute_patch(_Release019) is False
    assert "_checkpointed_forward" in _Release019.__dict__
    assert not hasattr(_Release019.__dict__["_checkpointed_forward"], "__wrapped__")


@pytest.mark.cpu
def test_the_installed_megatron_needs_it_exactly_on_the_affected_releases():
    core = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    release = core.__version__.split("+")[0]
    assert mtp_recompute_needs_patch() == (release in AFFECTED_RELEASES), release


@pytest.mark.cpu
def test_a_padding_mask_tensor_is_refused_on_the_affected_release():
    """On megatron-core 0.18.x (the compat matrix's cells): GPTModel with MTP, full recompute and
    a padding mask raises the refusal, not megatron's TypeError."""
    core = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    if not mtp_recompute_needs_patch():
        pytest.skip(f"n/a on megatron-core {core.__version__}: not 0.18.x, nothing to refuse")
    from repro import run_isolated

    # In a child: megatron's world set up (a process group, model-parallel state, the CPU
    # shims forced onto megatron's classes) would stay in the pytest worker for later tests.
    r = run_isolated(code="""
import torch
from fixes.megatron import MTPRecomputeRefused, apply_mtp_recompute_patch
from repro.mtp_full_recompute import build_gpt_mtp, gpt_mtp_grads, setup
setup("cpu")
apply_mtp_recompute_patch()
try:
    gpt_mtp_grads(build_gpt_mtp("cpu", recompute=True), "cpu",
                  padding_mask=torch.zeros(2, 16, dtype=torch.bool))
except MTPRecomputeRefused as e:
    print("REFUSED", "padding_mask" in str(e))
""", cwd=str(Path(__file__).parent.parent), timeout=300, forkserver=True)
    assert r.ok and "REFUSED True" in r.stdout, r.stderr[-3000:]
