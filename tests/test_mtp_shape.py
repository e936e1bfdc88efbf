"""The mtp-shape repro (crash 3): its mechanism, beyond the generic unfixed/fixed contract of
tests/test_repros.py. The crash runs in a child interpreter; the fixed path runs in-process with
the patch installed on the repro's model class for the test's duration."""

from __future__ import annotations

import pytest
import torch

from fixes.megatron import mtp_postprocess as mp
from repro import WrongResult, run_isolated
from repro.mtp_shape import MHCGPT, MTPShapeConfig, expand_streams, run
from repro.registry import reported_exception

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.cpu),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture
def patched_model_class():
    assert mp.apply_mtp_postprocess_patch(MHCGPT)
    try:
        yield MHCGPT
    finally:
        mp.remove_mtp_postprocess_patch(MHCGPT)


@pytest.mark.parametrize("device", DEVICES)
def test_unfixed_view_error_follows_the_shapes(device):
    """Another (s, b, n, h): the error is the MTP layer's view of contracted [s, b, h] states."""
    cfg = dict(seq_len=8, batch=3, streams=4, hidden=32, mtp_depths=2)
    code = (
        "from repro.mtp_shape import MTPShapeConfig, run\n"
        f"run(False, {device!r}, MTPShapeConfig(**{cfg!r}))\n"
    )
    result = run_isolated(code=code, timeout=120, forkserver=True)
    assert result.returncode == 1
    assert "shape '[8, 3, 4, 32]' is invalid for input of size 768" in result.stderr
    assert MTPShapeConfig(**cfg).crash_message == "shape '[8, 3, 4, 32]' is invalid for input of size 768"
    assert "hidden_states.view(s, b, self.n, self.h)" in result.stderr  # the MTP layer's view


@pytest.mark.parametrize("device", DEVICES)
def test_unfixed_path_through_the_harness_reports_the_runtime_error(device):
    from repro.mtp_shape import REPROS
    from repro.runner import run_path

    result = run_path(REPROS[0], fixed=False, device=device)
    exc = reported_exception(result.stderr)
    assert exc is not None and exc["types"][0] == "RuntimeError"
    assert exc["message"] == MTPShapeConfig().crash_message


@pytest.mark.cpu
def test_fixed_mtp_reads_the_decoder_streams(patched_model_class):
    cfg = MTPShapeConfig(mtp_depths=2)
    torch.manual_seed(0)
    model = patched_model_class(cfg)
    ids = torch.randint(0, cfg.vocab, (cfg.seq_len, cfg.batch))
    seen = {}
    model.decoder.register_forward_hook(lambda m, a, out: seen.update(decoder=out) or None)
    for i, layer in enumerate(model.mtp.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: seen.update({i: args[1]}) or None)
    lm_loss, mtp_losses = model(ids, torch.roll(ids, -1, 0))
    contracted, streams = seen["decoder"]
    n_h = cfg.streams * cfg.hidden
    assert contracted.shape == (cfg.seq_len, cfg.batch, cfg.hidden)
    assert streams.shape == seen[0].shape == seen[1].shape == (cfg.seq_len, cfg.batch, n_h)
    assert seen[0].untyped_storage().data_ptr() == streams.untyped_storage().data_ptr()
    assert mtp_losses.shape == (2,) and torch.isfinite(mtp_losses).all()
    (lm_loss + mtp_losses.sum()).backward()
    assert all(p.grad is not None for p in model.mtp.parameters())
    assert not model.mtp._forward_pre_hooks  # the forwarding hook lived for one call only


@pytest.mark.cpu
def test_oracle_rejects_a_shape_only_fix(monkeypatch):
    """Re-expanding the contracted states has the right shape and silences the crash, but the
    MTP then learns from a copy of the contracted stream, not the decoder's n streams."""

    def reexpanding_postprocess(self, hidden_states, input_ids, labels, mhc_multistream=None):
        return original(self, hidden_states, input_ids, labels,
                        mhc_multistream=expand_streams(hidden_states, self.cfg.streams))

    original = mp.wrap_postprocess(MHCGPT._postprocess)
    monkeypatch.setattr(MHCGPT, "_postprocess", reexpanding_postprocess)
    with pytest.raises(WrongResult, match="not the decoder's streams"):
        run(False, "cpu")


@pytest.mark.cpu
def test_fixed_run_passes_its_oracle_in_process(patched_model_class, capsys):
    run(True, "cpu", MTPShapeConfig(streams=3, hidden=16, mtp_depths=2))
    assert "depth input (16, 2, 48)" in capsys.readouterr().out


@pytest.mark.cpu
@pytest.mark.parametrize("bad", [dict(streams=1), dict(hidden=0), dict(mtp_depths=0)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=">= "):
        MTPShapeConfig(**bad)
