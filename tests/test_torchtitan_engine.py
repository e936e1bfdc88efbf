"""TorchtitanEngine on CPU for real: torchtitan llama3 / qwen3 ``debugmodel`` on a gloo process
group of world size 1, spmd_types backend, every AC mode. Steps lower the loss; AC changes no
loss and no gradient; attn_type reaches the built model; param groups reach the optimizer; a
step on a worker thread (init thread != step thread) gives the main thread's gradients and
runs inside the mesh context with autograd multithreading off only for the step; an engine
built from a Hugging Face config finds its flavor.

Kept cheap (2-core CI): seq_len 16, batch 1, three steps; one process group per module."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch

from repro.harness.optional import OptionalUnavailable, import_optional

try:  # torchtitan 0.3.0's models need torch >= 2.12 (torch 2.11: DataParallelMeshDims missing)
    import_optional("torchtitan.models")
    import_optional("torchtitan.trainer")
    _TITAN_ERROR = None
except OptionalUnavailable as exc:
    _TITAN_ERROR = exc

needs_titan_models = pytest.mark.skipif(_TITAN_ERROR is not None, reason=str(_TITAN_ERROR))
pytestmark = needs_titan_models

SEQ = 16
STEPS = 3
AC_MODES = ("selective", "full", "none")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """World size 1 on a FileStore (no port). With CUDA, nccl serves CUDA tensors (FSDP's
    collectives) and gloo the CPU ones."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not torch.cuda.is_available():
        from repro.harness.spmd_mesh import ensure_process_group

        ensure_process_group()
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)


def _engine(name, *, ac="selective", attn="sdpa", optimizer=None, device=None, **kw):
    from fixes.torchtitan.config import OptimizerSettings, TorchtitanEngineConfig
    from fixes.torchtitan.engine import TorchtitanEngine

    cfg = TorchtitanEngineConfig(
        attn_type=attn,
        activation_checkpoint=ac,
        dp_shard=1,
        optimizer=optimizer or OptimizerSettings(lr=3e-3, weight_decay=0.0),
        seed=1234,
    )
    return TorchtitanEngine(cfg, name=name, flavor="debugmodel", seq_len=SEQ, device=device, **kw)


def _batch(device="cpu", seed=0, n=1):
    from fixes.torchtitan.engine import MicroBatch

    g = torch.Generator().manual_seed(seed)
    return [MicroBatch(torch.randint(0, 2048, (1, SEQ + 1), generator=g).to(device)) for _ in range(n)]


def _grads(engine):
    out = {}
    for n, p in engine.model.named_parameters():
        g = p.grad
        n = n.replace("._checkpoint_wrapped_module", "")  # AC wrappers add a level
        out[n] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
    return out


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.cpu
def test_ac_without_checkpoint_wrappers_is_refused_by_version(process_group, monkeypatch):
    import fixes.torchtitan.engine as engine_module

    # As if torchtitan applied AC without CheckpointWrapper (torch_remat, torchtitan #4497).
    monkeypatch.setattr(engine_module, "make_checkpoint_wrappers_mesh_preserving", lambda m: 0)
    with pytest.raises(RuntimeError, match=r"torchtitan \d+\.\d+\.\d+: .*mesh_preserving_remat"):
        _engine("llama3", ac="selective")
    assert _engine("llama3", ac="none").mesh_preserving_wrappers == 0


@pytest.mark.deep
@pytest.mark.cpu
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_every_ac_mode_same_loss_and_grads_then_loss_falls(process_group, name):
    engines = {ac: _engine(name, ac=ac) for ac in AC_MODES}
    n_layers = len(engines["none"].model.layers)
    # the mesh-preserving context_fn is on every wrapper torchtitan's AC installed
    assert engines["selective"].mesh_preserving_wrappers == n_layers
    assert engines["full"].mesh_preserving_wrappers == n_layers
    assert engines["none"].mesh_preserving_wrappers == 0
    assert engines["selective"].inner_attention_types() == {"ScaledDotProductAttention"}

    batch = _batch()
    first = {ac: e.forward_backward_batch(batch) for ac, e in engines.items()}
    grads = {ac: _grads(e) for ac, e in engines.items()}
    for ac in ("selective", "full"):
        # recompute replays the same fp32 CPU ops: exactly the no-AC loss and gradients
        assert first[ac].losses == first["none"].losses
        assert _max_diff(grads[ac], grads["none"]) == 0.0

    for ac, e in engines.items():
        e.optimizer_step()
        losses = [first[ac].loss] + [e.train_step(batch).loss for _ in range(STEPS - 1)]
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), (ac, losses)


@pytest.mark.cpu
def test_step_on_worker_thread_matches_main_thread_inside_mesh_context(process_group):
    import spmd_types

    engine = _engine("llama3", ac="selective")
    batch = _batch(seed=1)
    seen = []

    def recording_loss(pred, labels, global_valid_tokens):
        from spmd_types import _state

        seen.append(
            (
                torch.autograd.is_multithreading_enabled(),
                bool(getattr(_state._tls, "mesh_stack", ())),
            )
        )
        return engine.loss_fn(pred, labels, global_valid_tokens)

    main = engine.forward_backward_batch(batch, recording_loss)
    main_grads = _grads(engine)
    engine.optimizers.zero_grad()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # init thread != step thread
        worker = pool.submit(engine.forward_backward_batch, batch, recording_loss).result()
        after = pool.submit(torch.autograd.is_multithreading_enabled).result()
    assert worker.losses == main.losses
    assert _max_diff(_grads(engine), main_grads) == 0.0
    # inside the step: multithreading off and a current mesh, on both threads
    assert seen == [(False, True), (False, True)]
    # ... and only for the step: the worker thread's setting is back, no mesh left behind
    assert after is True and torch.autograd.is_multithreading_enabled() is True
    assert not getattr(spmd_types._state._tls, "mesh_stack", ())

    engine.optimizers.zero_grad()
    result = engine.forward_backward_batch(_batch(n=2), forward_only=True)
    assert len(result.losses) == 2 and result.loss > 0
    assert all(p.grad is None for p in engine.model.parameters())


@pytest.mark.cpu
@pytest.mark.parametrize("attn,inner", [("flex", "FlexAttention"), ("varlen", "VarlenAttention")])
def test_attn_type_reaches_the_built_model(process_group, attn, inner):
    # verl #6182: attn_type was silently ignored. Built only: flex has no CPU backward and
    # varlen no CPU kernel (torch 2.13).
    from fixes.torchtitan.config import TorchtitanEngineConfig
    from fixes.torchtitan.engine import TorchtitanEngine

    hf = {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 8, "vocab_size": 2048}
    cfg = TorchtitanEngineConfig(attn_type=attn, activation_checkpoint="none", dp_shard=1)
    engine = TorchtitanEngine(cfg, hf_config=hf, seq_len=SEQ)
    assert (engine.name, engine.flavor) == ("qwen3", "debugmodel")  # derived from hf_config
    assert len(engine.model.layers) == 8
    assert engine.inner_attention_types() == {inner}


@pytest.mark.cpu
def test_flex_flash_without_hopper_is_an_error_not_a_fallback():
    from fixes.torchtitan.engine import build_model_spec

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("this machine has a Hopper/Blackwell GPU: flex_flash is buildable")
    with pytest.raises(ValueError, match="cannot build attn_type='flex_flash'.*Hopper"):
        build_model_spec("llama3", "debugmodel", "flex_flash")


@pytest.mark.cpu
def test_sdpa_where_torchtitan_attends_on_flat_tokens_is_refused_naming_what_is_allowed(
        monkeypatch):
    # torchtitan main's language-model attention takes flat (T, N, H) tokens (q_TNH); the
    # engine's sdpa swaps in ScaledDotProductAttention, which takes (B, L, N, H), and failed
    # deep in torchtitan's sharding (local_map ... in_dst_shardings is missing entries for
    # ['q_BLNH', ...]) in the compatibility matrix's torchtitan-main cell. The layout is read
    # from FlexAttention.forward's parameter names: here one with main's names.
    from torchtitan.models.common import attention

    from fixes.torchtitan.build import lm_attn_types
    from fixes.torchtitan.engine import build_model_spec

    assert "sdpa" in lm_attn_types()  # the installed release's (B, L, N, H) attention

    class FlatFlex(attention.FlexAttention):
        def forward(self, q_TNH, k_TNH, v_TNH, **kwargs):
            raise AssertionError("not called")

    monkeypatch.setattr(attention, "FlexAttention", FlatFlex)
    assert lm_attn_types() == ("flex", "flex_flash", "varlen")
    with pytest.raises(ValueError, match=r"cannot build attn_type='sdpa'.*flat \(T, N, H\).*"
                                         r"allowed there: \('flex', 'flex_flash', 'varlen'\)"):
        build_model_spec("llama3", "debugmodel", "sdpa")


@pytest.mark.cpu
def test_unknown_flavor_lists_the_registered_ones():
    from fixes.torchtitan.engine import build_model_spec

    with pytest.raises(ValueError, match="no flavor 'tiny'.*debugmodel"):
        build_model_spec("llama3", "tiny", "sdpa")


@pytest.mark.cpu
def test_the_training_config_names_the_length_as_the_installed_torchtitan_does():
    # torchtitan main (b5bcd76c) replaced TrainingConfig's seq_len / local_batch_size with
    # max_context_length / num_tokens_per_microbatch_per_dp_rank: the engine built with
    # seq_len=... failed there on both paths of mesh-recompute-tp2-silent-grad.
    import dataclasses

    from torchtitan.config import TrainingConfig

    from fixes.torchtitan.build import training_config

    released = training_config(TrainingConfig, 256, max_norm=0.5)
    assert (released.seq_len, released.local_batch_size, released.max_norm) == (256, 1, 0.5)

    @dataclasses.dataclass(kw_only=True)
    class MainTrainingConfig:  # the fields of torchtitan main's that the engine sets
        num_tokens_per_microbatch_per_dp_rank: int = 16384
        max_context_length: int = 2048
        max_norm: float = 1.0

    main = training_config(MainTrainingConfig, 256, max_norm=0.5)
    assert (main.max_context_length, main.num_tokens_per_microbatch_per_dp_rank,
            main.max_norm) == (256, 256, 0.5)

    @dataclasses.dataclass
    class Neither:
        max_norm: float = 1.0

    with pytest.raises(ValueError, match="neither seq_len / local_batch_size .* nor "
                                         "max_context_length"):
        training_config(Neither, 256)


@pytest.mark.cpu
def test_param_groups_reach_the_optimizer_and_the_update(process_group):
    from fixes.torchtitan.config import OptimizerSettings, ParamGroupSettings

    opt = OptimizerSettings(
        lr=1e-3,
        weight_decay=0.1,
        param_groups=(
            ParamGroupSettings(pattern=r"tok_embeddings", lr=1e-9),
            ParamGroupSettings(pattern=r"norm", weight_decay=0.0),
        ),
    )
    engine = _engine("llama3", ac="none", optimizer=opt)
    assert engine.param_group_of(r"tok_embeddings")["lr"] == 1e-9
    assert engine.param_group_of(r"layers\.0\.attention_norm")["weight_decay"] == 0.0
    assert engine.param_group_of(r"layers\.0\.attention_norm")["lr"] == 1e-3
    assert engine.param_group_of(r"lm_head")["lr"] == 1e-3
    assert engine.param_group_of(r"lm_head")["weight_decay"] == 0.1

    def local(name):
        p = dict(engine.model.named_parameters())[name]
        return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()

    before = {n: local(n) for n in ("tok_embeddings.weight", "lm_head.weight")}
    engine.train_step(_batch())
    # Adam's first step moves each parameter by about lr: the group's lr is the one applied
    emb = float((local("tok_embeddings.weight") - before["tok_embeddings.weight"]).abs().max())
    head = float((local("lm_head.weight") - before["lm_head.weight"]).abs().max())
    assert emb < 1e-8 < 1e-4 < head


@pytest.mark.cpu
def test_engine_argument_errors(process_group):
    from fixes.torchtitan.config import TorchtitanEngineConfig
    from fixes.torchtitan.engine import TorchtitanEngine

    cfg = TorchtitanEngineConfig(attn_type="sdpa", dp_shard=1)
    with pytest.raises(ValueError, match="either name= and flavor=, or hf_config="):
        TorchtitanEngine(cfg, name="llama3")
    with pytest.raises(ValueError, match="must be a TorchtitanEngineConfig"):
        TorchtitanEngine({"attn_type": "sdpa"}, name="llama3", flavor="debugmodel")


# ---- GPU (H200): the crash-1 setting for real -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("ac", ["selective", "full"])
def test_gpu_flex_step_on_pool_thread_with_multithreading_on(process_group, ac):
    """CUDA backward runs on autograd device threads unless the step turns that off; the
    engine is built on this thread and stepped on a pool thread, where the upstream
    init-time fix does not reach. flex attention, spmd_types, eager."""
    assert torch.autograd.is_multithreading_enabled()
    engine = _engine("llama3", ac=ac, attn="flex", device="cuda")
    batch = _batch(device="cuda", n=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        losses = [pool.submit(engine.train_step, batch).result().loss for _ in range(STEPS)]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


# ---- the smoke runner --------------------------------------------------------------------------


@pytest.mark.cpu
def test_smoke_runner_reports_each_cell_and_fails_on_a_failed_cell(tmp_path):
    from repro import run_isolated

    out = tmp_path / "rows.json"
    res = run_isolated(
        module="repro.harness.engine_smoke",
        args=["--attn", "sdpa,flex_flash", "--ac", "none", "--steps", "2", "--json", str(out)],
        env={"STACKFIX_SMOKE_SEQ_LEN": "8"},
        timeout=600, forkserver="torchtitan",
    )
    rows = {r["cell"].split()[1]: r for r in json.loads(out.read_text())}
    assert rows["sdpa"]["status"] == "ok", rows["sdpa"]
    assert rows["sdpa"]["losses"][1] < rows["sdpa"]["losses"][0]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("flex_flash is buildable here")
    assert rows["flex_flash"]["status"] == "failed"
    assert "cannot build attn_type='flex_flash'" in rows["flex_flash"]["detail"]
    assert res.returncode == 1 and "1 ok, 1 failed" in res.stdout


@pytest.mark.cpu
def test_smoke_runner_rejects_bad_values_before_running():
    from repro import run_isolated

    res = run_isolated(module="repro.harness.engine_smoke", args=["--ac", "partial"], timeout=120)
    assert res.returncode == 2
    assert "activation_checkpoint='partial' is not supported; allowed: 'selective', 'full', 'none'" in res.stderr
    res = run_isolated(module="repro.harness.engine_smoke", args=["--parallel", "tq=2"], timeout=120)
    assert res.returncode == 2 and "KEY one of" in res.stderr


# --- TP=2 without FSDP: one global grad norm, so replicated parameters stay in lockstep --------

_TP2_CLIP_WORKER = r'''
import json, sys
import torch, torch.distributed as dist
from fixes.torchtitan.config import TorchtitanEngineConfig
from fixes.torchtitan.engine import MicroBatch, TorchtitanEngine, canonical_param_name

norm_kind, sp, out_path = sys.argv[1], sys.argv[2] == "sp", sys.argv[3]
dist.init_process_group("gloo")
cfg = TorchtitanEngineConfig(tp=2, dp_shard=1, sequence_parallel=sp, attn_type="sdpa",
                             spmd_backend="spmd_types", activation_checkpoint="selective", seed=0)
engine = TorchtitanEngine(cfg, name="llama3", flavor="debugmodel", seq_len=16, device="cpu")
if norm_kind == "per-rank":  # the control: each rank clips by its own local norm
    engine._tp_total_norm = lambda: torch.nn.utils.get_total_norm(
        [p.grad for p in engine.model.parameters() if p.grad is not None])
batch = [MicroBatch(torch.randint(0, 2048, (1, 17), generator=torch.Generator().manual_seed(0)))]
norms, losses = [], []
for _ in range(2):  # max_norm 1.0 < the norm (~4.4): every step clips
    losses.append(float(engine.forward_backward_batch(batch).loss))
    norms.append(engine.optimizer_step())
replicated = {n: p.detach().clone() for n, p in engine.model.named_parameters()
              if p.numel() == engine._full_numel[canonical_param_name(n)]}
gathered = [None, None]
dist.all_gather_object(gathered, {"norms": norms, "replicated": replicated})
if dist.get_rank() == 0:
    a, b = gathered
    drift = max(float((a["replicated"][k] - b["replicated"][k]).abs().max()) for k in a["replicated"])
    with open(out_path, "w") as f:
        json.dump({"norms": [a["norms"], b["norms"]], "replicated": len(a["replicated"]),
                   "drift": drift, "losses": losses}, f)
dist.destroy_process_group()
'''


def _run_tp2_clip(norm_kind: str, tmp_path, sp: bool = False) -> dict:
    import sys
    from pathlib import Path

    from repro.harness.isolated import run_loopback_ranks

    out = tmp_path / f"{norm_kind}-{sp}.json"
    ranks = run_loopback_ranks(
        [sys.executable, "-c", _TP2_CLIP_WORKER, norm_kind, "sp" if sp else "no-sp", str(out)], 2,
        timeout=300,
        env={"OMP_NUM_THREADS": "1"}, cwd=str(Path(__file__).parent.parent), forkserver="torchtitan",
    )
    assert all(r.ok for r in ranks), "\n".join(r.describe() + r.stderr[-3000:] for r in ranks)
    return json.loads(out.read_text())


@pytest.mark.cpu
@pytest.mark.parametrize("norm_kind", ["engine", "per-rank"])
def test_tp2_without_fsdp_clips_by_one_global_norm(norm_kind, tmp_path):
    """TP without FSDP leaves plain local tensors; torchtitan's clip_grad_norm_ would then take
    each rank's local norm, clip the ranks by different factors, and the replicated parameters
    (norm weights) would drift apart. The engine's norm is global: equal on both ranks, and the
    replicated parameters stay bit-identical. The per-rank control shows the drift is visible."""
    result = _run_tp2_clip(norm_kind, tmp_path)
    rank0, rank1 = result["norms"]
    assert result["replicated"] > 0
    if norm_kind == "engine":
        assert rank0 == rank1 and all(n > 1.0 for n in rank0), result  # clipping was active
        assert result["drift"] == 0.0, result
        # torchtitan's default, sequence parallel, at TP=2: the same norms and losses (up to
        # float reassociation), and the replicated parameters still stay in lockstep.
        sp = _run_tp2_clip(norm_kind, tmp_path, sp=True)
        assert sp["norms"][0] == sp["norms"][1] and sp["drift"] == 0.0, sp
        assert sp["losses"] == pytest.approx(result["losses"], rel=1e-5), (sp, result)
        assert sp["norms"][0] == pytest.approx(rank0, rel=1e-5), (sp, result)
    else:
        assert rank0 != rank1 and result["drift"] > 0.0, result
