"""verl's released recompute reclaims (0.8.0, 0.9.1) on megatron-core, and what 0.9.1's MTP skip
sees. verl 0.9.1 skips a checkpoint when a closure cell of its ``run_function`` holds an object of
class ``MultiTokenPredictionLayer``; megatron-core 0.16.1 checkpoints its MTP layer through a bound
method, which has no closure. Every case runs in a child interpreter: one verl release per
process, and a crash must end a child, not pytest."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from verl_megatron import DEVICES, need_verl_on_megatron

from repro import run_isolated
from repro.verl_release import release_dir

REPO = Path(__file__).parent.parent
_need = need_verl_on_megatron


def _child(code: str, timeout: float = 300):
    # Prepended, not replaced: a PYTHONPATH that already carries the stack (an offline GPU box's
    # wheel target) must reach the child too.
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"),
                                       os.environ.get("PYTHONPATH", "")) if p)
    return run_isolated(code=textwrap.dedent(code), timeout=timeout, cwd=str(REPO),
                        env={"PYTHONPATH": path}, forkserver=True)


@pytest.mark.cpu
@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_install_reclaim_installs_the_released_function_and_none_restores(version):
    _need(version)
    r = _child(f"""
        from megatron.core.tensor_parallel.random import CheckpointFunction
        from repro.harness.megatron_world import setup_megatron
        from repro.reclaims import install_reclaim
        setup_megatron("cpu")
        original = CheckpointFunction.__dict__["backward"]
        install_reclaim("verl-{version}")
        code = CheckpointFunction.backward.__code__
        assert code.co_filename == {str(release_dir(version) / "verl/models/mcore/patch.py")!r}
        assert code.co_name == "patch_backward", code.co_name
        install_reclaim("ours", over="verl-{version}")  # replaces verl's, wraps megatron's own
        # the very function this process imported: the harness looked at the class before verl
        # assigned its reclaim, and stackfix kept megatron's own backward then
        own = CheckpointFunction.__dict__["backward"].__func__.__wrapped__
        assert own is original.__func__
        install_reclaim("none")  # megatron's own again, the same descriptor
        assert CheckpointFunction.__dict__["backward"] is original
        print("INSTALL-OK")
    """)
    assert r.ok and "INSTALL-OK" in r.stdout, r.stderr[-3000:]


# Which checkpoint inputs each release frees, by how the MTP checkpoint is made. No reader of
# the input after the backward here, so nothing crashes: the freed storage is simply observed.
FREES = {
    "0.8.0": {"closure": True, "bound-method": True},
    "0.9.1": {"closure": False, "bound-method": True, "verl-run": True},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("version", sorted(FREES))
def test_which_mtp_checkpoints_verl_frees(version, device):
    _need(version)
    r = _child(f"""
        import json, torch
        from repro.harness.megatron_world import setup_megatron
        from repro.mtp_checkpoints import megatron_mtp_checkpoint
        from repro.reclaims import install_reclaim
        from repro.shared_view_reclaim import MultiTokenPredictionLayer
        setup_megatron({device!r})
        install_reclaim("verl-{version}")
        freed = {{}}
        for form in {sorted(FREES[version])!r}:
            layer = MultiTokenPredictionLayer(8).to({device!r})
            part = torch.randn(4, 8, device={device!r}, requires_grad=True)
            megatron_mtp_checkpoint(form)(layer, part).sum().backward()
            freed[form] = part.untyped_storage().nbytes() == 0
        print("FREED", json.dumps(freed))
    """)
    assert r.ok, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FREED ")][-1]
    assert json.loads(line[len("FREED "):]) == FREES[version]


def real_mtp_block_scenario(device: str) -> None:
    """megatron-core's own MultiTokenPredictionBlock (local spec, full recompute, training) fed
    decoder states ``h`` that a contraction also saved (mHC's shape, verl #7328), under verl
    0.9.1's reclaim. Prints the form of the MTP checkpoint the installed release made, then
    dies (freed storage read) or prints the grad check."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import multi_token_prediction as mtp_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from repro.harness.megatron_world import setup_megatron
    from repro.reclaims import install_reclaim

    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import install_megatron_cpu_memory_buffer_shim

        install_megatron_cpu_memory_buffer_shim(force=True)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, mtp_num_layers=1,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    block = mtp_module.MultiTokenPredictionBlock(
        config=cfg, spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    ).to(device)
    block.train()
    proj = torch.nn.Linear(64, 64).to(device)
    mix = torch.nn.Parameter(torch.linspace(0.5, 1.5, 64, device=device))
    emb = torch.nn.Embedding(128, 64).to(device)
    s, b = 16, 2
    x = torch.randn(s, b, 64, device=device)
    ids = torch.randint(0, 128, (b, s), device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).tril().logical_not()

    run_functions = []
    checkpoint = tensor_parallel.checkpoint

    def recording_checkpoint(function, *args):
        run_functions.append(function)
        return checkpoint(function, *args)

    tensor_parallel.checkpoint = recording_checkpoint  # the MTP module looks it up at call time

    def step():
        for p in [*block.parameters(), *proj.parameters(), mix, *emb.parameters()]:
            p.grad = None
        h = proj(x)
        contract = h * mix  # saves h for its backward
        out = block(input_ids=ids, position_ids=pos, hidden_states=h, attention_mask=mask,
                    embedding=lambda input_ids, position_ids: emb(input_ids).transpose(0, 1))
        del h
        (contract.square().mean() + out.square().mean()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return [p.grad.clone() for p in [*block.parameters(), *proj.parameters(), mix]]

    reference = step()
    fn = run_functions[-1]
    if getattr(fn, "__self__", None) is not None:
        form, held = "bound-method", [fn.__self__]
    else:
        form, held = "closure", [c.cell_contents for c in fn.__closure__ or ()]
    layer = "MultiTokenPredictionLayer" in [type(o).__name__ for o in held]
    print("FORM", form, "holds-layer" if layer else "no-layer", flush=True)
    install_reclaim("verl-0.9.1")
    got = step()
    install_reclaim("none")
    assert all(torch.allclose(g, r) for g, r in zip(got, reference, strict=True))
    print("GRADS-EQUAL", flush=True)


@pytest.mark.parametrize("device", DEVICES)
def test_verl091_on_megatrons_own_mtp_block(device):
    """The realism check of ``shared-view-reclaim-verl091``: the installed megatron-core's own MTP
    block. 0.16.x checkpoints the layer through a bound method: verl 0.9.1 frees the input and
    the contraction's backward reads freed memory. Megatron-LM core_v0.19.0+ uses a closure over
    the layer: the skip fires and the grads are right (its memory is not reclaimed either)."""
    _need("0.9.1")
    r = _child(f"""
        import test_verl_reclaim as t
        t.real_mtp_block_scenario({device!r})
    """)
    form_line = [ln for ln in r.stdout.splitlines() if ln.startswith("FORM ")]
    assert form_line, f"{r.describe()}\n{r.stderr[-3000:]}"
    _, form, layer = form_line[0].split()
    assert layer == "holds-layer"  # self of the bound method, or a closure cell
    if form == "bound-method":
        crashed = r.signal is not None or "an illegal memory access" in r.stderr
        assert crashed, f"{r.describe()}\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}"
    else:
        assert r.ok and "GRADS-EQUAL" in r.stdout, f"{r.describe()}\n{r.stderr[-3000:]}"
