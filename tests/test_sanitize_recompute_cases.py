"""``recompute_sanitizer`` on the cases issue 34 names: recomputes whose ops differ while what
backward uses is equal raise nothing (a cache built on first use, matmul lowered by grad mode,
an FP8 meta stash and restore, declared differences; megatron-core and FSDP2:
``test_sanitize_recompute_real_models``); recomputes that hand
backward other values are caught although their ops match (an early-stopped recompute that
never fills a saved tensor, a permutation, a NaN next to a doubled value); float8 values never
crash; and the sanitizer's own failure never reaches the user's forward."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fixes.sanitize import (
    RecomputeMismatchError,
    RecomputeSanitizerWarning,
    recompute_may_differ,
    recompute_sanitizer,
    scratch_tensors,
)

pytestmark = [pytest.mark.cpu, pytest.mark.no_stackfix_sanitize]


def _grads(step) -> list[torch.Tensor]:
    torch.manual_seed(3)
    return [g.clone() for g in step()]


def _same_grads(step, values: str = "all") -> list[torch.Tensor]:
    """``step`` (returning gradients) without and under the sanitizer: equal, bitwise."""
    reference = _grads(step)
    with recompute_sanitizer(values=values):
        got = _grads(step)
    for a, b in zip(reference, got, strict=True):
        assert torch.equal(a, b)
    return got


# -- what backward uses is equal: nothing raised -------------------------------------------------


class Rotary(torch.nn.Module):
    """cos / sin tables built on first use, as rotary embeddings cache them."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 8**0.5)
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x):
        if self.cache is None:
            angles = torch.arange(x.shape[0]).unsqueeze(-1) * torch.linspace(0.1, 1.0, 8)
            self.cache = (angles.cos(), angles.sin())
        cos, sin = self.cache
        h = x @ self.w
        return h * cos + h.roll(1, dims=-1) * sin


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_a_cache_built_in_the_first_forward_is_no_difference(reentrant, values):
    """The forward builds the tables, its recompute finds them built: the op streams differ,
    the saved tensors and outputs do not (issue 34: raised (op) at the cache builder)."""

    def step():
        layer = Rotary()
        x = torch.randn(6, 8, requires_grad=True)
        checkpoint(layer, x, use_reentrant=reentrant).pow(2).sum().backward()
        return [x.grad, layer.w.grad]

    _same_grads(step, values)


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_matmul_lowered_by_grad_mode_is_no_difference(values):
    """``torch.matmul`` of a 3-D and a 2-D tensor folds into one ``mm`` when the 2-D operand
    does not require grad, and runs ``clone`` / ``bmm`` when it does: a reentrant forward runs
    without grad, its recompute with, so the ops differ (issue 34: raised at ``aten.clone``)
    and the outputs may differ in the last bits. The op streams part at that lowering alone:
    the outputs are compared within the tolerance, and a real change is still caught."""
    w = torch.randn(8, 6, requires_grad=True)

    def region(t):
        return torch.matmul(t.transpose(0, 1), w.to(torch.bfloat16).float())

    def run(change: float = 1.0):
        w.grad = None
        torch.manual_seed(3)
        x = torch.randn(4, 3, 8, requires_grad=True)
        y = checkpoint(region, x, use_reentrant=True)
        with torch.no_grad():
            w.mul_(change)
        y.pow(2).sum().backward()
        with torch.no_grad():
            w.div_(change)

    with recompute_sanitizer(values=values) as sanitizer:
        for _ in range(2):  # all: the locator finds the lowering in the second
            run()
    assert sanitizer.lowerings_accepted == (0 if values == "none" else 1)
    assert sanitizer.detections == 0
    if values != "none":  # a real change at the same call site is still one
        with pytest.raises(RecomputeMismatchError, match=r"output #0"):
            with recompute_sanitizer(values=values):
                for _ in range(2):
                    run(change=1.5)


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_an_fp8_meta_stash_and_restore_is_no_side_effect(values):
    """TransformerEngine's FP8 recompute handling, modelled (``recompute_bugs._fp8_meta``): the
    recompute copies the forward's scales into the live meta and back, a write into outside
    state whose net effect is none (issue 34: raised as a side effect)."""
    from recompute_bugs import _fp8_meta

    reference = _fp8_meta.step(checkpointing=False, stash=True, keep_copies=True)
    with recompute_sanitizer(values=values) as sanitizer:
        got = _fp8_meta.step(checkpointing=True, stash=True, keep_copies=True)
    assert sanitizer.recomputes == 1 and sanitizer.detections == 0  # restored: no change
    for name in reference:
        assert torch.equal(reference[name].float(), got[name].float()), name


def test_transformer_engines_recompute_functions_are_built_in(tmp_path, monkeypatch):
    """Ops run directly in TransformerEngine's ``get_old_fp8_meta_tensors_for_recompute`` and
    ``restore_fp8_meta_tensors`` are left out of the op stream (matched by TE's file and
    function names; TE is not installed here: a module at TE's path stands in); their writes
    are still checked: a restore that does not restore is TransformerEngine#1723."""
    package = tmp_path / "transformer_engine" / "pytorch"
    package.mkdir(parents=True)
    for d in (package.parent, package):
        (d / "__init__.py").write_text("")
    (package / "fp8.py").write_text(textwrap.dedent('''
        def get_old_fp8_meta_tensors_for_recompute(meta, stash, keep):
            meta["updated"] = meta["scale"].clone() if keep else meta["scale"]
            meta["scale"].copy_(stash)

        def restore_fp8_meta_tensors(meta):
            meta["scale"].copy_(meta["updated"])
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m.startswith("transformer_engine")}
    try:
        _stand_in_for_transformer_engine()
    finally:  # a transformer_engine left importable changes how megatron-core imports
        for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _stand_in_for_transformer_engine():
    from transformer_engine.pytorch import fp8

    def run(keep: bool):
        meta = {"scale": torch.ones(1)}
        calls = []

        def layer(x):
            calls.append(1)
            stash = meta["scale"].clone() if len(calls) == 1 else None
            if len(calls) > 1:
                fp8.get_old_fp8_meta_tensors_for_recompute(meta, run.stash, keep)
            else:
                run.stash = stash
            out = x * meta["scale"].clone()
            if len(calls) > 1:
                fp8.restore_fp8_meta_tensors(meta)
            return out

        x = torch.randn(4, requires_grad=True)
        y = checkpoint(layer, x, use_reentrant=True)
        meta["scale"].mul_(2.0)  # the update between forward and backward
        y.sum().backward()
        return meta["scale"]

    with recompute_sanitizer() as sanitizer:
        assert run(keep=True).item() == 2.0
        assert run(keep=True).item() == 2.0  # where the locator would run
    assert sanitizer.detections == 0
    with pytest.raises(RecomputeMismatchError, match=r"\(side effect\): aten.copy_.default"):
        with recompute_sanitizer():
            run(keep=False)
            run(keep=False)  # located


# -- declared intended differences ---------------------------------------------------------------


def test_a_declared_update_the_forward_skipped_is_accepted_once():
    """``recompute_may_differ(..., writes="update")``: an update made only under grad (so in a
    reentrant recompute, not in its no-grad forward) is accepted; the same update made in the
    forward too is applied twice, and raised."""
    counter = torch.zeros(())

    @recompute_may_differ("logged only under grad", writes="update")
    def log(t):
        with torch.no_grad():
            counter.add_(t.detach().sum())

    def layer(t):
        if torch.is_grad_enabled():
            log(t)
        return t.sin()

    x = torch.randn(4, requires_grad=True)
    for values in ("all", "none"):
        counter.zero_()
        with recompute_sanitizer(values=values) as sanitizer:
            checkpoint(layer, x, use_reentrant=True).sum().backward()  # forward under no-grad
        assert sanitizer.declared_writes == 1 and counter.item() == pytest.approx(x.sum().item())
    with pytest.raises(RecomputeMismatchError, match=r"\(side effect\)"):
        with recompute_sanitizer():  # non-reentrant: the forward runs under grad and logs too
            for _ in range(2):  # the locator tells the declaration's writes apart
                checkpoint(layer, x, use_reentrant=False).sum().backward()


def test_declared_scratch_is_not_checked():
    buffer = torch.zeros(4)
    scratch_tensors(buffer, reason="a workspace no one reads without writing it first")

    def layer(t):
        buffer.copy_(t.detach() * 3)
        return t.sin() * buffer

    with recompute_sanitizer():
        x = torch.randn(4, requires_grad=True)
        y = checkpoint(layer, x, use_reentrant=False)
        buffer.zero_()
        y.sum().backward()

    with recompute_may_differ("a block's workspace", writes="scratch"):
        pass  # the context-manager form


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="writes must be one of 'restore', 'update', 'scratch'"):
        recompute_may_differ("why", writes="sometimes")
    with pytest.raises(ValueError, match="give the reason"):
        recompute_may_differ("")
    with pytest.raises(TypeError, match="takes tensors"):
        scratch_tensors([1.0], reason="no")


# -- what backward uses differs while the ops match: caught --------------------------------------


def test_an_early_stopped_recompute_that_never_fills_a_saved_tensor_is_caught(monkeypatch):
    """``nn.RReLU``: its noise is saved before ``rrelu_with_noise`` fills it, and the early
    stop ends the recompute right before that op (pytorch#193671; silent in every mode
    before)."""
    torch.manual_seed(0)
    rrelu, x = torch.nn.RReLU().train(), torch.randn(8, 16, requires_grad=True)
    # Uninitialised memory filled: the unfilled noise never happens to hold the forward's
    # (the allocator may hand the recompute the forward's freed buffer, contents intact).
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RecomputeMismatchError) as caught:
            with recompute_sanitizer():
                for _ in range(2):  # detected in the first, located in the second
                    checkpoint(lambda t: rrelu(t * 2), x, use_reentrant=False).sum().backward()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    error = caught.value
    assert (error.verdict, error.what, error.op) == (
        "saved tensor", "early stop", "aten.rrelu_with_noise.default")
    assert "pytorch#193671" in str(error) and error.forward_site and not error.recompute_site


def test_a_permutation_drawn_anew_is_caught():
    """``randperm`` in a recompute without the RNG state restored: the same tokens in another
    order, the same (sum, norm) (issue 34: silent)."""
    x = torch.randn(16, 8, requires_grad=True)
    with pytest.raises(RecomputeMismatchError) as caught:
        with recompute_sanitizer():
            for _ in range(2):
                y = checkpoint(lambda t: t[torch.randperm(t.shape[0])], x, use_reentrant=False,
                               preserve_rng_state=False)
                (y * torch.linspace(0.0, 1.0, 16).unsqueeze(-1)).sum().backward()
    assert caught.value.verdict == "saved tensor" and caught.value.op == "aten.randperm.default"


def test_a_nan_does_not_hide_a_doubled_value():
    """``x * torch.tensor(vals)``, one value NaN, 1.0 -> 2.0 elsewhere: twice the gradients
    (issue 34: silent, NaN == NaN and nothing else compared)."""
    state = {"scale": 1.0}

    def region(t):
        vals = [state["scale"]] * 8
        vals[3] = float("nan")
        return t * torch.tensor(vals)

    x = torch.randn(8, requires_grad=True)
    with pytest.raises(RecomputeMismatchError) as caught:
        with recompute_sanitizer():
            for _ in range(2):
                state["scale"] = 1.0
                y = checkpoint(region, x, use_reentrant=False)
                state["scale"] = 2.0
                y.nansum().backward()
    assert caught.value.verdict == "saved tensor" and caught.value.what == "values"


# -- never the user's failure --------------------------------------------------------------------


@pytest.mark.parametrize("values", ["all", "sampled"])
def test_float8_values_do_not_crash(values):
    """Issue 34: every float8 output crashed the user's forward with "Promotion for Float8
    Types is not supported"."""
    w = torch.randn(8, 8, requires_grad=True)

    def region(t):
        return (t.to(torch.float8_e4m3fn).to(torch.float32) @ w).tanh()

    def step():
        w.grad = None
        checkpoint(region, torch.randn(4, 8), use_reentrant=False).sum().backward()
        return [w.grad]

    _same_grads(step, values)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize(("part", "values"), [("fingerprint", "all"), ("reach", "all"),
                                              ("reach", "none")])
def test_the_sanitizers_own_failure_leaves_the_region_unchecked(monkeypatch, part, values,
                                                                reentrant):
    """A failure inside the sanitizer -- its fingerprint kernel, or finding what a region
    reaches when its recompute starts -- is reported as a warning naming it; the region runs
    unchecked and the user's forward and backward run on with the gradients they have
    without the sanitizer (a failure finding the reach escaped from the backward once, an
    ``UnboundLocalError`` PyTorch's nested-checkpoint tests found)."""
    from fixes.sanitize import _fused, _reach

    def broken(*args, **kwargs):
        raise RuntimeError(f"{part} failed")

    w = torch.randn(8, 8, requires_grad=True)

    def step():
        w.grad = None
        x = torch.randn(4, 8, requires_grad=True)
        checkpoint(lambda t: (t @ w).sin(), x, use_reentrant=reentrant).sum().backward()
        return [x.grad, w.grad]

    reference = _grads(step)
    if part == "fingerprint":
        monkeypatch.setattr(_fused, "side_prints", broken)  # the detect tier's prints
    else:
        monkeypatch.setattr(_reach.Walks, "reach", broken)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with recompute_sanitizer(values=values) as sanitizer:
            got = _grads(step)
    ours = [w for w in seen if issubclass(w.category, RecomputeSanitizerWarning)]
    assert ours and f"{part} failed" in str(ours[0].message)
    assert sanitizer.internal_errors and "the region runs unchecked" in str(ours[0].message)
    for a, b in zip(reference, got, strict=True):
        assert torch.equal(a, b)


# -- views in the op stream (review of the view rule) ----------------------------------------------


def test_a_weight_changed_before_backward_is_located_at_its_view_when_the_recompute_stops_there():
    """``x + lin2(lin1(x).relu())``, lin2's weight changed between forward and backward: addmm
    packs its inputs before it runs, so the early-stopped recompute ends at F.linear's ``t`` of
    the weight -- the one op that shows the change. A view of a parameter is fingerprinted."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def block(x):
        h = lin1(x).relu()
        return x + lin2(h)  # the changed weight enters here

    for values in ("all",):
        with pytest.raises(RecomputeMismatchError) as caught:
            with recompute_sanitizer(values=values):
                for _ in range(2):  # detected in the first, located in the second
                    loss = checkpoint(block, torch.randn(4, 8, requires_grad=True),
                                      use_reentrant=False).pow(2).sum()
                    with torch.no_grad():
                        lin2.weight.mul_(2)
                    loss.backward()
                    with torch.no_grad():
                        lin2.weight.div_(2)
        assert caught.value.what == "values" and caught.value.op.startswith("aten.t"), values
        assert "in block" in caught.value.recompute_site[0], values


def test_the_locator_names_the_op_before_a_region_ending_in_a_view():
    """A region that returns ``h.view(-1)`` ends with an unprinted view; the op before it,
    where the values differ, is named (``sampled`` once dropped it: nothing located)."""
    state = {"scale": 1.0}

    def region(x):
        h = x
        for _ in range(9):
            h = h.sin()  # ops 0..8: 0, 4, 8 sampled
        h = h * state["scale"]  # op 9: where it differs, unsampled
        return h.view(-1)  # op 10: a view, the side's last

    with pytest.raises(RecomputeMismatchError) as caught:
        with recompute_sanitizer():
            for _ in range(2):
                state["scale"] = 1.0
                y = checkpoint(region, torch.randn(4, 8, requires_grad=True), use_reentrant=True)
                state["scale"] = 2.0
                y.sum().backward()
    assert caught.value.what == "values" and caught.value.op.startswith("aten.mul")


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("make", ["tensor", "as_tensor", "new_tensor"])
def test_a_constant_made_in_the_region_and_written_in_place_is_no_side_effect(make, reentrant):
    """``torch.tensor([0.]).add_(1)`` in a region: the constant is lifted by an aliasing
    ``lift_fresh``, so its storage counted as outside the region and its write as a side
    effect."""
    build = {"tensor": lambda x: torch.tensor([0.0, 1.0]),
             "as_tensor": lambda x: torch.as_tensor([1.0, 2.0]),
             "new_tensor": lambda x: x.new_tensor([1.0, 2.0])}[make]

    def region(x):
        return (x * build(x).add_(1).sum()).sin()

    for values in ("all", "none"):
        with recompute_sanitizer(values=values):
            checkpoint(region, torch.randn(4, 8, requires_grad=True),
                       use_reentrant=reentrant).pow(2).sum().backward()
