"""fixes.megatron.mtp_postprocess: the wrapper forwards ``mhc_multistream`` to the MTP call only
when given and accepted, and is a bit-identical no-op on megatron-core releases (crash 3).

Torch-only tests use the repro's mHC model (repro/mtp_shape.py). The megatron tests build a tiny
GPT + MTP with the local spec (2 layers, hidden 64, seq 16, world size 1): on CPU with
megatron-core 0.16.1 through fixes/testing/megatron_cpu.py, on the H200 with 0.19.2."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fixes.megatron import mtp_postprocess as mp
from repro.mtp_shape import MHCGPT, MTPBlock, MTPShapeConfig

# ---------------------------------------------------------------------------------------------
# torch only
# ---------------------------------------------------------------------------------------------


@pytest.mark.cpu
def test_accepts_kwarg_needs_a_declared_parameter():
    def declared(self, x, mhc_multistream=None): ...
    def keyword_only(self, x, *, mhc_multistream=None): ...
    def var_kw(self, x, **kwargs): ...
    def other(self, x, padding_mask=None): ...

    assert mp.accepts_kwarg(declared, "mhc_multistream")
    assert mp.accepts_kwarg(keyword_only, "mhc_multistream")
    assert not mp.accepts_kwarg(var_kw, "mhc_multistream")  # **kwargs would spread it anywhere
    assert not mp.accepts_kwarg(other, "mhc_multistream")
    assert not mp.accepts_kwarg(len, "mhc_multistream")


class _ReleaseStyleMTP(nn.Module):
    """An MTP block with a release's signature: no mhc_multistream parameter."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, input_ids, hidden_states, embedding):
        self.calls.append(hidden_states)
        return hidden_states


class _DroppingGPT(nn.Module):
    """A postprocess that takes mhc_multistream and drops it (verl's copy before #7328)."""

    def __init__(self, mtp):
        super().__init__()
        self.mtp = mtp

    def _postprocess(self, hidden_states, input_ids, mhc_multistream=None):
        return self.mtp(input_ids=input_ids, hidden_states=hidden_states, embedding=None)


class _NoKwargGPT(_DroppingGPT):
    """A postprocess with a release's signature (no mhc_multistream parameter at all)."""

    def _postprocess(self, hidden_states, input_ids):
        return self.mtp(input_ids=input_ids, hidden_states=hidden_states, embedding=None)


class _DevStyleGPT(_DroppingGPT):
    """A postprocess that forwards it itself (Megatron-LM dev's GPTModel._postprocess)."""

    def _postprocess(self, hidden_states, input_ids, mhc_multistream=None):
        return self.mtp(input_ids=input_ids, hidden_states=hidden_states, embedding=None,
                        mhc_multistream=mhc_multistream)


class _RecordingMTP(nn.Module):
    """A real MTP-shaped module whose forward declares mhc_multistream; records what it got."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, input_ids, hidden_states, embedding, mhc_multistream=None):
        self.calls.append(mhc_multistream)
        return hidden_states


@pytest.mark.cpu
@pytest.mark.parametrize("gpt_cls", [_DroppingGPT, _NoKwargGPT, _DevStyleGPT])
def test_wrapper_forwards_the_streams_to_an_mtp_that_accepts_them(gpt_cls):
    model = gpt_cls(_RecordingMTP())
    wrapped = mp.wrap_postprocess(gpt_cls._postprocess)
    h, ids = torch.randn(4, 1, 8), torch.zeros(4, 1, dtype=torch.long)
    streams = torch.randn(4, 1, 16)
    wrapped(model, h, ids, mhc_multistream=streams)
    assert len(model.mtp.calls) == 1 and model.mtp.calls[0] is streams
    wrapped(model, h, ids)  # not given: nothing injected
    assert model.mtp.calls[1] is None
    # the hook lives only for one call: a later direct call of the MTP gets nothing injected
    model.mtp(input_ids=ids, hidden_states=h, embedding=None)
    assert model.mtp.calls[2] is None and not model.mtp._forward_pre_hooks


@pytest.mark.cpu
def test_wrapper_drops_the_streams_with_a_warning_when_the_mtp_cannot_take_them():
    model = _DroppingGPT(_ReleaseStyleMTP())
    wrapped = mp.wrap_postprocess(_DroppingGPT._postprocess)
    h, ids = torch.randn(4, 1, 8), torch.zeros(4, 1, dtype=torch.long)
    with pytest.warns(RuntimeWarning, match="no 'mhc_multistream' parameter"):
        out = wrapped(model, h, ids, mhc_multistream=torch.randn(4, 1, 16))
    assert out is h and model.mtp.calls == [h]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing given: silent no-op
        assert wrapped(model, h, ids) is h


@pytest.mark.cpu
def test_wrapper_passes_the_kwarg_to_an_original_that_takes_it_and_not_otherwise():
    seen = {}

    def takes(self, h, mhc_multistream=None):
        seen["takes"] = mhc_multistream

    def release(self, h):
        seen["release"] = "called"

    holder = nn.Module()
    s = torch.randn(1)
    mp.wrap_postprocess(takes)(holder, 0, mhc_multistream=s)
    mp.wrap_postprocess(release)(holder, 0, mhc_multistream=s)  # no TypeError
    assert seen == {"takes": s, "release": "called"}
    # the wrapper's signature shows the keyword, so signature probes see it
    assert mp.accepts_kwarg(mp.wrap_postprocess(release), "mhc_multistream")
    assert mp.wrap_postprocess(mp.wrap_postprocess(release)).__wrapped__ is release


@pytest.mark.cpu
def test_apply_and_remove_are_idempotent_and_restore_the_original():
    class Own(MHCGPT):
        def _postprocess(self, *a, **k):
            return super()._postprocess(*a, **k)

    class Inherited(MHCGPT):
        pass

    for cls in (Own, Inherited):
        before = cls.__dict__.get("_postprocess")
        assert not mp.is_mtp_postprocess_patched(cls)
        assert mp.apply_mtp_postprocess_patch(cls) is True
        wrapper = cls.__dict__["_postprocess"]
        assert mp.apply_mtp_postprocess_patch(cls) is False
        assert cls.__dict__["_postprocess"] is wrapper  # not wrapped twice
        assert mp.is_mtp_postprocess_patched(cls)
        assert mp.remove_mtp_postprocess_patch(cls) is True
        assert mp.remove_mtp_postprocess_patch(cls) is False
        assert cls.__dict__.get("_postprocess") is before
    assert not mp.is_mtp_postprocess_patched(MHCGPT)  # the base class was never touched


def _verl_style_postprocess(self, hidden_states, input_ids):
    """A per-instance replacement as verl's patch_postprocess assigns it: an old body, no
    mhc_multistream, no padding_mask."""
    return self.mtp(input_ids=input_ids, hidden_states=hidden_states, embedding=None)


class _PatchableGPT(_DroppingGPT):
    """A fresh class per test, so the class-level patch never leaks."""


@pytest.mark.cpu
@pytest.mark.parametrize("order", ["instance-first", "class-first"])
def test_a_per_instance_replacement_is_wrapped_whenever_it_is_assigned(order):
    cls = type("GPT", (_PatchableGPT,), {})
    model = cls(_RecordingMTP())
    h, ids, streams = torch.randn(4, 1, 8), torch.zeros(4, 1, dtype=torch.long), torch.randn(4, 1, 16)
    if order == "class-first":
        assert mp.apply_mtp_postprocess_patch(cls)
    backup = model._postprocess  # verl: model._postprocess_backup = model._postprocess
    model._postprocess = _verl_style_postprocess.__get__(model, cls)  # verl: patch_postprocess
    if order == "instance-first":
        assert mp.apply_mtp_postprocess_patch(cls)
    assert "_postprocess" in model.__dict__  # the replacement is stored, not discarded
    model._postprocess(h, ids, mhc_multistream=streams, padding_mask=None)
    assert model.mtp.calls[-1] is streams
    model._postprocess = backup  # verl: unpatch_postprocess
    if order == "class-first":
        assert "_postprocess" not in model.__dict__  # the class's own (wrapped) again
    model._postprocess(h, ids, mhc_multistream=streams)
    assert model.mtp.calls[-1] is streams
    assert mp.remove_mtp_postprocess_patch(cls)
    model._postprocess = _verl_style_postprocess.__get__(model, cls)
    with pytest.raises(TypeError, match="mhc_multistream"):  # unpatched: a plain attribute
        model._postprocess(h, ids, mhc_multistream=streams)


@pytest.mark.cpu
def test_keywords_the_wrapped_postprocess_lacks_are_dropped_only_when_none():
    """dev's GPTModel.forward passes padding_mask/output_processor=None to a postprocess copied
    from an older GPTModel (verl 0.8.0's): None is the copy's own assumption, a value is not."""
    model = _NoKwargGPT(_RecordingMTP())
    wrapped = mp.wrap_postprocess(_NoKwargGPT._postprocess)
    h, ids = torch.randn(4, 1, 8), torch.zeros(4, 1, dtype=torch.long)
    assert wrapped(model, h, ids, padding_mask=None, output_processor=None) is h
    with pytest.raises(TypeError, match="padding_mask"):
        wrapped(model, h, ids, padding_mask=torch.zeros(1, 4, dtype=torch.bool))


@pytest.mark.cpu
def test_repro_mtp_block_declares_the_parameter_the_wrapper_looks_for():
    # the repro's fixed path goes through the same accept check as megatron's MTP block
    assert mp.mtp_accepts_multistream(MTPBlock(MTPShapeConfig()))
    assert not mp.mtp_accepts_multistream(_ReleaseStyleMTP())
    assert not mp.mtp_accepts_multistream(None)


# ---------------------------------------------------------------------------------------------
# real megatron-core: tiny GPT + MTP, local spec, world size 1
# ---------------------------------------------------------------------------------------------

SEQ, BATCH, VOCAB = 16, 2, 128


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("cpu", marks=pytest.mark.cpu),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def megatron_world(request, tmp_path_factory):
    """World size 1 with megatron's model-parallel state; torn down if this fixture set it up."""
    device = request.param
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fixes.testing.megatron_cpu import install_megatron_cpu_shims

    if device == "cpu" and torch.cuda.is_available():
        # megatron's CPU shims are process-wide and only installed where CUDA is absent; on a
        # CUDA machine the cuda variant of these tests runs instead.
        pytest.skip("the CPU megatron variant runs on CPU-only machines")
    created_pg = created_mp = False
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store,
                                rank=0, world_size=1)
        created_pg = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        created_mp = True
    if device == "cpu":
        # megatron-core hard-codes CUDA in its RNG tracker and in GlobalMemoryBuffer (used by
        # the local spec's DotProductAttention); the project's one shim module handles both.
        install_megatron_cpu_shims()
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    yield device
    if created_mp:
        parallel_state.destroy_model_parallel()
    if created_pg:
        dist.destroy_process_group()


def _tiny_gpt_mtp(device):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, mtp_num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     mtp_block_spec=mtp_spec).to(device)
    # Training mode logs the MTP loss into a tracker allocated with torch.cuda.current_device()
    # (MTPLossLoggingHelper.save_loss_to_tracker); on CPU run eval mode (no dropout here anyway).
    model.train(device == "cuda")
    assert model.mtp_process and model.mtp is not None
    return model


def _batch(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    pos = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device=device).tril().logical_not()
    return ids, pos, mask, torch.roll(ids, -1, 1)


def _loss_and_grads(model, ids, pos, mask, labels):
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, mask, labels=labels)  # [b, s] LM loss; MTP loss rides on backward
    loss.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def test_wrapped_postprocess_is_bit_identical_on_the_installed_release(megatron_world):
    from megatron.core.models.gpt.gpt_model import GPTModel

    device = megatron_world
    model = _tiny_gpt_mtp(device)
    batch = _batch(device)
    ref_loss, ref_grads = _loss_and_grads(model, *batch)
    assert mp.apply_mtp_postprocess_patch() is True
    try:
        assert mp.is_mtp_postprocess_patched(GPTModel)
        loss, grads = _loss_and_grads(model, *batch)
    finally:
        mp.remove_mtp_postprocess_patch()
    assert not mp.is_mtp_postprocess_patched(GPTModel)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    # the MTP loss reached the MTP parameters through MTPLossAutoScaler
    assert any(n.startswith("mtp.") and g.abs().sum() > 0 for n, g in grads.items())
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def _postprocess_kwargs(model, device):
    ids, pos, mask, labels = _batch(device)
    hidden = torch.randn(SEQ, BATCH, model.config.hidden_size, device=device, requires_grad=True)
    return dict(hidden_states=hidden, input_ids=ids, position_ids=pos, labels=labels,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                mtp_in_postprocess=True, attention_mask=mask)


def test_wrapper_forwards_streams_to_a_megatron_mtp_block_that_declares_them(megatron_world):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    class StreamAwareMTPBlock(MultiTokenPredictionBlock):
        """The installed MTP block with dev's extra parameter; records what it was handed and
        runs the installed (contracted-states) path."""

        def forward(self, *args, mhc_multistream=None, **kwargs):
            self.received = mhc_multistream
            return super().forward(*args, **kwargs)

    device = megatron_world
    model = _tiny_gpt_mtp(device)
    model.mtp.__class__ = StreamAwareMTPBlock
    kwargs = _postprocess_kwargs(model, device)
    streams = torch.randn(SEQ, BATCH, 2 * model.config.hidden_size, device=device)
    original = GPTModel._postprocess
    if not mp.accepts_kwarg(original, "mhc_multistream"):  # every release through 0.19.2
        with pytest.raises(TypeError, match="mhc_multistream"):
            original(model, **kwargs, mhc_multistream=streams)
    wrapped = mp.wrap_postprocess(original)
    without = wrapped(model, **kwargs)
    assert model.mtp.received is None
    with_streams = wrapped(model, **kwargs, mhc_multistream=streams)
    assert model.mtp.received is streams
    assert torch.equal(with_streams, without)  # the recording block ignores them otherwise


def test_wrapper_drops_streams_for_the_stock_megatron_mtp_block(megatron_world):
    from megatron.core.models.gpt.gpt_model import GPTModel

    device = megatron_world
    model = _tiny_gpt_mtp(device)
    kwargs = _postprocess_kwargs(model, device)
    if mp.mtp_accepts_multistream(model.mtp):
        pytest.skip("this megatron-core's MTP block has the mHC path (dev branch)")
    wrapped = mp.wrap_postprocess(GPTModel._postprocess)
    expected = wrapped(model, **kwargs)
    with pytest.warns(RuntimeWarning, match="mhc_multistream"):
        got = wrapped(model, **kwargs,
                      mhc_multistream=torch.randn(SEQ, BATCH, 128, device=device))
    assert torch.equal(got, expected)
