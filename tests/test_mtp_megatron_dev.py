"""Crash 3 against real Megatron-LM dev (repro/mtp_shape_megatron_dev.py), beyond the generic
unfixed/fixed contract of tests/test_repros.py: the skip without a checkout, the checkout check,
verl 0.9.1 on dev, where the crash is raised, the upstream bug the harness works around, and the
oracle against a shape-only fix. Everything that imports the checkout runs in a child process
(the checkout goes first on sys.path; one verl release per process)."""

from __future__ import annotations

import textwrap

import pytest

from repro import discover, run_isolated
from repro.harness.megatron_lm import (
    ENV_VAR,
    PINNED_COMMIT,
    MegatronLMCheckoutError,
    check_megatron_lm_checkout,
    skip_reason,
    use_megatron_lm_checkout,
)
from repro.registry import SKIP_EXIT_CODE
from repro.runner import judge_fixed, judge_unfixed, run_path

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.cpu),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
needs_checkout = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
DEV_REPROS = ["mtp-shape-megatron-dev", "mtp-shape-megatron-dev-verl080"]


def _child(body: str, timeout: float = 300.0):
    """Run ``body`` in a child; a repro.Skipped there (verl release not installed) skips."""
    code = "import sys\nfrom repro.registry import Skipped\ntry:\n" + textwrap.indent(
        textwrap.dedent(body), "    "
    ) + f"\nexcept Skipped as e:\n    print('SKIP', e, file=sys.stderr)\n    sys.exit({SKIP_EXIT_CODE})\n"
    result = run_isolated(code=code, timeout=timeout)
    if result.returncode == SKIP_EXIT_CODE:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    return result


@pytest.mark.deep
@pytest.mark.cpu
@pytest.mark.parametrize("name", DEV_REPROS)
def test_without_a_checkout_both_paths_are_skipped_with_the_reason(name, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")
    repro = discover()[name]
    unfixed = judge_unfixed(repro, run_path(repro, fixed=False, device="cpu"), "cpu")
    fixed = judge_fixed(run_path(repro, fixed=True, device="cpu"))
    for outcome in (unfixed, fixed):
        assert outcome.status == "skipped"
        assert f"{ENV_VAR} is not set" in outcome.detail and PINNED_COMMIT[:8] in outcome.detail


@pytest.mark.cpu
def test_a_checkout_without_mhc_is_refused_naming_the_pinned_commit(tmp_path, monkeypatch):
    with pytest.raises(MegatronLMCheckoutError, match="no megatron/core/transformer"):
        check_megatron_lm_checkout(tmp_path)
    for rel, text in [("megatron/core/transformer/multi_token_prediction.py", "def forward(): ...\n"),
                      ("megatron/core/models/gpt/gpt_model.py", "mhc_multistream = None\n")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(MegatronLMCheckoutError, match=f"has no mhc_multistream.*{PINNED_COMMIT[:8]}"):
        use_megatron_lm_checkout()  # refused before anything reaches sys.path


@needs_checkout
@pytest.mark.parametrize("device", DEVICES)
def test_verl_091_runs_on_dev_without_the_fix_and_matches_dev_own_postprocess(device):
    result = _child(f"""
        from repro.mtp_shape_megatron_dev import run_scenario
        run_scenario(False, {device!r}, streams_dropped=False, version="0.9.1")
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "verl 0.9.1 postprocess: MTP loss" in result.stdout


@needs_checkout
@pytest.mark.parametrize("device", DEVICES)
def test_the_unfixed_crash_is_dev_mtp_layer_viewing_contracted_states(device):
    result = _child(f"""
        from repro.mtp_shape_megatron_dev import run_streams_dropped
        run_streams_dropped(False, {device!r})
    """)
    assert result.returncode == 1
    assert "RuntimeError: shape '[16, 2, 2, 64]' is invalid for input of size 2048" in result.stderr
    # raised by dev's own code, MultiTokenPredictionLayer._concat_embeddings
    assert "multi_token_prediction.py" in result.stderr
    assert "hidden_states.view(s, b, n, h)" in result.stderr


@needs_checkout
@pytest.mark.parametrize("device", DEVICES)
def test_dev_local_spec_cannot_backprop_mhc_mtp_without_the_workaround(device):
    """Pins the upstream bug repro/harness/megatron_lm.py works around: when this starts
    passing, dev fixed it and the workaround can go."""
    result = _child(f"""
        from repro.harness.megatron_lm import use_megatron_lm_checkout
        use_megatron_lm_checkout()
        from repro.harness.megatron_world import setup_megatron
        setup_megatron({device!r})
        if {device!r} == "cpu":
            from fixes.testing.megatron_cpu import install_megatron_cpu_shims
            install_megatron_cpu_shims(force=True)
        from repro.mtp_shape_megatron_dev import DevMTPConfig, build_dev_gpt, make_batch, train_step
        cfg = DevMTPConfig()
        train_step(build_dev_gpt(cfg, {device!r}), make_batch(cfg, {device!r}))
    """)
    assert result.returncode == 1
    assert "t() expects a tensor with <= 2 dimensions, but self is 4D" in result.stderr
    assert "tensor_parallel/layers.py" in result.stderr


@needs_checkout
@pytest.mark.cpu
def test_oracle_rejects_a_shape_only_fix():
    """Handing MTP n copies of the contracted states has the right shape and silences the crash;
    the loss and gradients then differ from dev's own postprocess, and the depth input is not
    the decoder's streams."""
    result = _child("""
        from fixes.megatron.mtp_postprocess import forwarding_mhc_multistream
        from repro.registry import WrongResult
        from repro import mtp_shape_megatron_dev as dev

        cfg = dev.DevMTPConfig()
        dev.setup_dev_megatron("cpu")
        model, batch = dev.build_dev_gpt(cfg, "cpu"), dev.make_batch(cfg, "cpu")
        reference = dev.train_step(model, batch)
        dev.install_verl_postprocess(model, streams_dropped=True)
        dropping = model._postprocess

        def copies_of_the_contracted_states(*args, **kwargs):
            copies = kwargs["hidden_states"].repeat(1, 1, cfg.streams)
            with forwarding_mhc_multistream(model.mtp, copies):
                return dropping(*args, **kwargs)

        model._postprocess = copies_of_the_contracted_states
        got = dev.train_step(model, batch)
        for check in (lambda: dev.check_reads_the_streams(got, cfg),
                      lambda: dev.check_matches_reference(got, reference, cfg)):
            try:
                check()
            except WrongResult as e:
                print("REJECTED:", e)
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    rejected = [line for line in result.stdout.splitlines() if line.startswith("REJECTED:")]
    assert len(rejected) == 2, result.stdout
    assert "not the decoder's streams" in rejected[0]
    assert "differs from dev's own postprocess" in rejected[1]
