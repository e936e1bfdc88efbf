"""``fixes.sanitize.recompute_sanitizer``: a checkpointed region whose recompute computes
something else than its forward where backward uses it raises RecomputeMismatchError naming
where the recompute first departs (the op, its position, what differs, both call sites); a
region that replays its forward passes with the same gradients as unsanitized, on every
checkpoint kind. The error cases run in child processes (one scenario each); the clean ones
in-process, asserting what was compared (regions, recomputes, ops)."""

from __future__ import annotations

import gc
import json
import textwrap
import weakref

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointError,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fixes.sanitize import RecomputeMismatchError, recompute_sanitizer
from repro import run_isolated

# torch's own warning for a reentrant checkpoint none of whose inputs requires grad: the
# never-recomputed tests make exactly that region
_NO_INPUT_REQUIRES_GRAD = "ignore:None of the inputs have requires_grad:UserWarning"

pytestmark = [pytest.mark.cpu, pytest.mark.no_stackfix_sanitize]

# -- error cases, each in a child ----------------------------------------------------------------

PRELUDE = '''
import json, torch
from torch.utils.checkpoint import checkpoint
from fixes.sanitize import RecomputeMismatchError, recompute_sanitizer
torch.manual_seed(0)
lin = torch.nn.Linear(8, 8)
state = {"scale": 1.0, "wide": False}
def report(run):
    try:
        with recompute_sanitizer():
            for _ in range(2):  # the detect tier finds it in the first step, the locator names it in the second
                state.update(scale=1.0, wide=False)
                run()
    except RecomputeMismatchError as e:
        print("MISMATCH " + json.dumps({"what": e.what, "position": e.position, "op": e.op,
              "forward_site": e.forward_site, "recompute_site": e.recompute_site,
              "message": str(e)}))
    else:
        print("NO-MISMATCH")
'''

SCENARIOS = {
    # state read by the region changed between forward and backward -> the same op, other values
    "values-reentrant": '''
def f(x):
    return torch.relu(lin(x)) * state["scale"]  # LINE-OP
def run():
    y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum()
    state["scale"] = 2.0
    y.backward()
''',
    "values-non-reentrant": '''
def f(x):
    h = torch.relu(lin(x)) * state["scale"]  # LINE-OP
    return h.sin()
def run():
    y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum()
    state["scale"] = 2.0
    y.backward()
''',
    # a branch on state: the recompute runs another op
    "op": '''
def f(x):
    h = lin(x)
    h = h.cos() if state["wide"] else h.sin()  # LINE-OP
    return h * h
def run():
    y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum()
    state["wide"] = True
    y.backward()
''',
    "metadata": '''
def f(x):
    n = 6 if state["wide"] else 4
    h = lin(x)[:, :n].contiguous()  # LINE-OP
    return h.sin()
def run():  # torch's own check off: the sanitizer's error (else torch's, with it as a note)
    y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False,
                   determinism_check="none").sum()
    state["wide"] = True
    y.backward()
''',
    # a buffer updated inside the region is updated again by the recompute
    "side-effect": '''
calls = torch.zeros(())
def f(x):
    calls.add_(1)  # LINE-OP
    return lin(x).sin()
def run():
    checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
''',
    # dropout in a region whose RNG state is not restored
    "rng": '''
def f(x):
    return torch.nn.functional.dropout(lin(x), 0.5).sin()  # LINE-OP
def run():
    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(f, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
''',
    # a reentrant recompute that runs an op its forward did not: no forward op is named as
    # its counterpart
    "inserted": '''
def f(x):
    h = lin(x)
    if state["wide"]:
        h = h * 2.0  # LINE-OP
    return h.tanh()
def run():
    y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum()
    state["wide"] = True
    y.backward()
''',
    # a reentrant recompute that skips an op its forward ran (the forward's op has no
    # counterpart: it is named alone)
    "length": '''
def f(x):
    h = lin(x)
    if not state["wide"]:
        h = h.sin()  # LINE-OP
    return h
def run():
    y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum()
    state["wide"] = True
    y.backward()
''',
}


def _mismatch(name: str) -> dict:
    code = PRELUDE + textwrap.dedent(SCENARIOS[name]) + "\nreport(run)\n"
    r = run_isolated(code=code, timeout=120, forkserver=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("MISMATCH", "NO-MISMATCH"))]
    assert lines and lines[-1].startswith("MISMATCH "), r.stdout + r.stderr[-2000:]
    found = json.loads(lines[-1][len("MISMATCH "):])
    op_line = code.splitlines().index(next(ln for ln in code.splitlines() if "LINE-OP" in ln)) + 1
    found["op_line"] = f"<string>:{op_line} in "
    return found


@pytest.mark.parametrize("name,what,op", [
    ("values-reentrant", "values", "aten.mul.Tensor"),
    ("values-non-reentrant", "values", "aten.mul.Tensor"),
    ("op", "op", "aten.cos.default"),
    ("metadata", "not located", None),  # torch fails on it: raised in the first step
    ("side-effect", "side effect", "aten.add_.Tensor"),
    ("rng", "values", "aten.bernoulli_.float"),
    ("length", "op", "aten.sin.default"),
    ("inserted", "op", "aten.mul.Tensor"),
])
def test_first_difference_is_named(name, what, op):
    found = _mismatch(name)
    assert (found["what"], found["op"]) == (what, op), found
    assert found["message"].startswith("recompute of checkpointed region f ("), found
    if name == "metadata":
        assert "saved tensor #2 of 3: forward ([4, 4]" in found["message"], found
        assert "recompute ([4, 6]" in found["message"], found
        return
    if name == "inserted":
        assert "which its forward did not run: no forward op corresponds to it" in (
            found["message"])
        assert found["recompute_site"][0].startswith(found["op_line"]) and not (
            found["forward_site"]), found
        assert "Forward op at (none: the forward did not run this op)" in found["message"]
        return
    if name == "length":
        assert "the forward ran aten.sin.default, which the recompute did not run" in (
            found["message"])
        assert found["forward_site"][0].startswith(found["op_line"]) and not (
            found["recompute_site"]), found
        return
    # Both call sites name the line of the differing op, in the forward and the recompute.
    assert found["forward_site"][0].startswith(found["op_line"]), found
    if what != "op":
        assert found["recompute_site"][0].startswith(found["op_line"]), found
    assert f"at op #{found['position']} ({what})" in found["message"]


# -- clean regions: compared, passing, gradients unchanged ---------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                               torch.nn.LayerNorm(8), torch.nn.Dropout(0.1))


def _grads(model, step) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    step(model, x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _sac_context():
    def policy(ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        save = func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


STEPS = {
    "non-reentrant": lambda m, x: checkpoint(m, x, use_reentrant=False),
    "reentrant": lambda m, x: checkpoint(m, x, use_reentrant=True),
    "selective": lambda m, x: checkpoint(m, x, use_reentrant=False, context_fn=_sac_context),
    "nested": lambda m, x: checkpoint(
        lambda t: checkpoint(m[:2], t, use_reentrant=False).sin() + m[2:](t[:, :16].new_zeros(
            t.shape[0], 16) + 1).sum(), x, use_reentrant=False),
}


@pytest.mark.parametrize("values", ["all", "sampled"])
@pytest.mark.parametrize("kind", list(STEPS))
def test_clean_regions_pass_with_unchanged_gradients(kind, values):
    step = STEPS[kind]
    reference = _grads(_model(), step)
    with recompute_sanitizer(values=values, sample_every=3) as sanitizer:
        got = _grads(_model(), step)
    assert sanitizer.regions >= 1 and sanitizer.recomputes >= 1
    assert sanitizer.saved_compared + sanitizer.outputs_compared >= 1
    assert sanitizer.fingerprints >= 2 and sanitizer.detections == sanitizer.located == 0
    for a, b in zip(reference, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_the_modules_are_walked_once_while_unchanged(values):
    """The walk of what the regions reach (``_reach.Walks``): every mode keeps one walk while
    no module, parameter or buffer is registered (``all`` checks it each step instead of
    walking again: ``tests/test_sanitize_reach.py``); a registration makes the next region
    walk anew, and the registration hooks go on exit."""
    walks = 1
    from torch.nn.modules import module as nn_module

    hooks = len(nn_module._global_buffer_registration_hooks)
    model = _model()
    layers = [model[:2], model[2:]]
    with recompute_sanitizer(values=values) as sanitizer:
        for _ in range(4):
            h = torch.randn(4, 8, requires_grad=True)
            for layer in layers:  # two regions a step, each its own set of modules
                h = checkpoint(layer, h, use_reentrant=True)
            h.sum().backward()
        assert sanitizer.module_walks == walks * 2
        model[0].register_buffer("late", torch.zeros(2))
        checkpoint(layers[0], torch.randn(4, 8, requires_grad=True),
                   use_reentrant=True).sum().backward()
        assert sanitizer.module_walks == walks * 2 + 1
        assert len(nn_module._global_buffer_registration_hooks) == hooks + 1
    assert len(nn_module._global_buffer_registration_hooks) == hooks
    assert sanitizer.detections == 0


def test_non_reentrant_recompute_stops_after_the_last_saved_tensor():
    """Early stop: the recompute runs a prefix of the forward (here: without the final sin,
    whose input is the last saved tensor) and passes."""
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        return (x @ w).sin() * 3.0

    with recompute_sanitizer() as sanitizer:
        checkpoint(f, torch.randn(4, 8), use_reentrant=False).sum().backward()
    assert sanitizer.recomputes == 1 and sanitizer.detections == 0
    assert sanitizer.saved_compared == 2  # the mm's input and output; sin's output unneeded


def test_values_none_compares_metadata_not_values_and_keeps_no_op_stream():
    state = {"scale": 1.0}
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        return (x @ w * state["scale"]).sin()

    with recompute_sanitizer(values="none") as sanitizer:
        y = checkpoint(f, torch.randn(4, 8), use_reentrant=False).sum()
        state["scale"] = 2.0
        y.backward()  # other values, same metadata: not seen in this mode
    assert sanitizer.recomputes == 1 and sanitizer.saved_compared >= 2
    assert sanitizer.ops_compared == 0 and sanitizer.fingerprints == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_values_none_still_names_a_metadata_change_and_an_outside_write(reentrant):
    """Without an op stream ``none`` still judges: a saved tensor or output of other shape,
    and a write outside the region (with the write's own site), unlocated otherwise."""
    state = {"n": 4}
    counter = torch.zeros(())

    def shape_changes(x):
        return (x[: state["n"]] * 2.0).sin()

    with pytest.raises(torch.utils.checkpoint.CheckpointError) as error:
        with recompute_sanitizer(values="none"):
            y = checkpoint(shape_changes, torch.randn(6, 8, requires_grad=True),
                           use_reentrant=reentrant).sum()
            state["n"] = 3
            y.backward()
    if reentrant:
        assert "Not located" in str(error.value) and error.value.position is None
    else:  # torch's own check fails it first: the sanitizer's finding is its note
        assert "Not located" in error.value.__notes__[0]

    def counts(x):
        counter.add_(1)
        return x.sin()

    with pytest.raises(RecomputeMismatchError, match=r"contents back") as error:
        with recompute_sanitizer(values="none"):
            checkpoint(counts, torch.randn(6, 8, requires_grad=True),
                       use_reentrant=reentrant).sum().backward()
    assert error.value.verdict.name == "SIDE_EFFECT" and float(counter) == 1.0


def test_a_scratch_buffer_allocated_by_the_first_forward_only_is_no_difference():
    """Megatron's GlobalMemoryBuffer.get_tensor allocates its buffer (``empty``) on the first
    call and slices it afterwards, so on a model's first step the forward allocates and the
    recompute does not: the op sequences differ by an allocation, the computation does not (a
    false positive on every megatron-core model's first sanitized step, seen on CPU)."""
    buffers: dict[str, torch.Tensor] = {}
    w = torch.randn(8, 8, requires_grad=True)

    def get_tensor(shape):
        if "mpu" not in buffers:
            buffers["mpu"] = torch.empty(64)
        return buffers["mpu"][: shape[0] * shape[1]].view(shape)

    def f(x):  # beta=0: the buffer's values are never read
        return torch.addmm(get_tensor((4, 8)), x, w, beta=0.0).tanh()

    with recompute_sanitizer() as sanitizer:
        for _ in range(2):  # the first forward allocates, the later ones do not
            checkpoint(f, torch.randn(4, 8, requires_grad=True),
                       use_reentrant=False).sum().backward()
    assert sanitizer.recomputes == 2 and sanitizer.detections == 0


def _chain(state: dict, at: int):
    """A region of 12 elementwise ops; op ``at`` reads ``state``."""

    def f(x):
        h = x
        for i in range(12):
            h = h * state["scale"] if i == at else h.sin()
        return h

    return f


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_a_divergence_is_located_on_the_next_round_in_all_and_raised_at_once_otherwise(values):
    """The detect tier finds the changed scale in step 1; ``all`` arms the locator, whose op
    stream names the op in step 2 (both sites); ``sampled`` (region 0 of the site is printed)
    raises it unlocated in step 1; ``none`` prints nothing: not seen."""
    state = {"scale": 1.0}
    f = _chain(state, 6)
    steps = 0
    with pytest.raises(RecomputeMismatchError) if values != "none" else _nothing() as caught, \
            recompute_sanitizer(values=values, sample_every=4) as sanitizer:
        for _ in range(2):
            steps += 1
            state["scale"] = 1.0
            y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum()
            state["scale"] = 2.0
            y.backward()
    if values == "all":
        assert steps == 2 and sanitizer.located == 1
        assert (caught.value.what, caught.value.position, caught.value.op) == (
            "values", 6, "aten.mul.Tensor")
        assert caught.value.forward_site and caught.value.recompute_site
    elif values == "sampled":
        assert steps == 1 and caught.value.what == "not located"
        assert caught.value.verdict == "output" and "values='all' locates" in str(caught.value)
    else:
        assert steps == 2 and sanitizer.detections == 0 and sanitizer.fingerprints == 0


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_a_divergence_that_does_not_recur_is_raised_unlocated():
    """Detected in step 1, the region's next round (step 2) recomputes what its forward did:
    the detection is raised, saying it did not recur."""
    state = {"scale": 1.0, "changed": False}
    f = _chain(state, 6)
    with pytest.raises(RecomputeMismatchError, match="did not recur") as caught, \
            recompute_sanitizer() as sanitizer:
        for step in range(2):
            y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum()
            state["scale"] = 2.0 if step == 0 else state["scale"]
            y.backward()
    assert sanitizer.located == 1 and caught.value.what == "not located"


def test_a_divergence_of_the_last_step_is_raised_when_the_sanitizer_exits():
    state = {"scale": 1.0}
    with pytest.raises(RecomputeMismatchError, match="ran no further region"), \
            recompute_sanitizer():
        y = checkpoint(_chain(state, 3), torch.randn(4, 8, requires_grad=True),
                       use_reentrant=True).sum()
        state["scale"] = 2.0
        y.backward()


def test_sampled_prints_every_kth_region_of_a_call_site_rotating():
    """Six layers at one call site, ``sample_every=3``, six steps: two layers printed a step,
    and the printed layers move from step to step, so every layer is printed within three
    steps (a multiple of k layers does not pin the same ones)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    printed: list[set[int]] = []
    with recompute_sanitizer(values="sampled", sample_every=3) as sanitizer:
        for _ in range(6):
            before, layers = sanitizer.fingerprints, set()
            h = torch.randn(2, 4, requires_grad=True)
            for i, layer in enumerate(model):
                n = sanitizer.fingerprints
                h = checkpoint(layer, h, use_reentrant=True)
                if sanitizer.fingerprints > n:
                    layers.add(i)
            h.sum().backward()
            assert sanitizer.fingerprints > before
            printed.append(layers)
    assert all(len(p) == 2 for p in printed), printed
    assert set().union(*printed[:3]) == set(range(6)), printed
    assert sanitizer.detections == 0


def test_the_detect_tier_installs_no_dispatch_mode():
    """During a sanitized step no TorchDispatchMode is on the stack: inside the region's
    forward and recompute the innermost mode is the caller's (as torch's
    ``test_storage_lifetime`` asserts of the checkpoint's own)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    seen = []

    def f(x):
        seen.append(list(_get_current_dispatch_mode_stack()))
        return x.sin().cos()

    with recompute_sanitizer() as sanitizer:
        for reentrant in (False, True):
            checkpoint(f, torch.randn(4, requires_grad=True), use_reentrant=reentrant).sum().backward()
    assert sanitizer.recomputes == 2 and seen == [[], [], [], []]


def test_bad_values_mode_or_sample_interval_is_refused():
    with pytest.raises(ValueError, match=r"values must be one of 'all', 'sampled', 'none'"):
        with recompute_sanitizer(values="some"):
            pass
    with pytest.raises(ValueError, match=r"sample_every must be an int >= 1, got 0"):
        with recompute_sanitizer(values="sampled", sample_every=0):
            pass
    # one spelling per mode: a bool meant "all" or "none" before, and read as neither
    with pytest.raises(ValueError, match=r"values must be one of 'all', 'sampled', 'none'.*True"):
        with recompute_sanitizer(values=True):
            pass
    with recompute_sanitizer():  # the refusals left nothing active
        pass


def test_torch_remat_regions_are_compared():
    torch_remat = pytest.importorskip("torch_remat")
    model = _model()[:4]
    remat = torch_remat.checkpoint(region_name="block", preserve_rng_state=False)(model)
    with recompute_sanitizer() as sanitizer:
        remat(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert sanitizer.regions == 1 and sanitizer.recomputes == 1 and sanitizer.saved_compared > 3


def test_megatron_checkpoint_function_regions_are_compared():
    pytest.importorskip("megatron.core")
    from megatron.core import tensor_parallel

    from fixes.testing.megatron_cpu import install_megatron_cpu_rng_shim

    install_megatron_cpu_rng_shim()
    model = _model()[:4]
    reference = _grads(model, lambda m, x: tensor_parallel.checkpoint(m, False, x))
    with recompute_sanitizer() as sanitizer:
        got = _grads(model, lambda m, x: tensor_parallel.checkpoint(m, False, x))
    assert "megatron.core.tensor_parallel.random.CheckpointFunction.forward" in sanitizer.wrapped
    assert sanitizer.regions == 1 and sanitizer.recomputes == 1
    assert sanitizer.outputs_compared == 1 and sanitizer.detections == 0
    for a, b in zip(reference, got, strict=True):
        assert torch.equal(a, b)


def test_megatron_checkpoint_without_output_regions_are_compared():
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    from fixes.testing.megatron_cpu import install_megatron_cpu_rng_shim

    install_megatron_cpu_rng_shim()
    state = {"scale": 1.0}
    w = torch.randn(8, 8, requires_grad=True)

    def region(x):
        return torch.tanh(x @ w) * state["scale"]

    def step(change: bool):
        x = torch.randn(4, 8, requires_grad=True)
        ckpt = CheckpointWithoutOutput(fp8=None)  # 0.16.1: fp8=False reads as "fp8 on"
        h = ckpt.checkpoint(region, x)
        y = h.sin()  # saves h: the storage the checkpoint discards and recomputes
        ckpt.discard_output_and_register_recompute(y)
        state["scale"] = 2.0 if change else 1.0
        y.sum().backward()

    with recompute_sanitizer() as sanitizer:
        step(change=False)
    assert sanitizer.recomputes == 1 and sanitizer.outputs_compared == 1
    with pytest.raises(RecomputeMismatchError, match=r"CheckpointWithoutOutput.*\(values\)"):
        with recompute_sanitizer():
            for _ in range(2):
                state["scale"] = 1.0
                step(change=True)
    state["scale"] = 1.0


def test_a_tests_own_entry_joins_the_plugins_only_with_its_arguments():
    from fixes.sanitize._callsite import entered_as

    with entered_as("by the plugin", "mark the test", joinable=True), \
            recompute_sanitizer(values="sampled") as outer:
        with recompute_sanitizer(values="sampled") as inner:
            assert inner is outer
        with pytest.raises(RuntimeError, match=r"already active \(entered by the plugin with "
                           r"values='sampled', sample_every=8, not values='all', sample_every=8\)"):
            with recompute_sanitizer():
                pass


def test_everything_is_put_back_and_nesting_is_refused():
    import torch.utils.checkpoint as tuc

    before = (tuc._checkpoint_without_reentrant_generator,
              tuc.CheckpointFunction.__dict__["forward"])
    with recompute_sanitizer():
        assert tuc._checkpoint_without_reentrant_generator is not before[0]
        with pytest.raises(RuntimeError, match=r"recompute_sanitizer\(\) is already active"):
            with recompute_sanitizer():
                pass
    assert (tuc._checkpoint_without_reentrant_generator,
            tuc.CheckpointFunction.__dict__["forward"]) == before
    with pytest.raises(RecomputeMismatchError), recompute_sanitizer():  # usable again
        buf = torch.zeros(())
        checkpoint(lambda t: buf.add_(1) + t.sin(), torch.randn(2, requires_grad=True),
                   use_reentrant=False).sum().backward()
    assert tuc._checkpoint_without_reentrant_generator is before[0]


@pytest.mark.cpu
def test_an_ops_own_rng_state_outputs_are_not_compared():
    """H200 finding: every CUDA SDPA region failed as a value mismatch, because the efficient
    attention kernel returns the philox seed and offset it drew, and a recompute draws new ones
    (no effect on the result with dropout off). Such returns are left out by schema name."""
    from fixes.sanitize import _fingerprint as fp

    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    outs = [torch.full((2,), float(i)) for i in range(len(op._schema.returns))]
    assert [t[0].item() for t in fp.valued_outputs(op, outs)] == [0.0, 1.0]  # output, lse
    add = torch.ops.aten.add.Tensor
    assert fp.valued_outputs(add, outs[:1]) == outs[:1]


def test_views_of_the_regions_own_tensors_are_unprinted_and_a_changed_weights_view_is_named():
    """A view of a tensor the region made has that op's values: recorded (metadata, site), not
    fingerprinted. A view of a weight is where a changed weight enters: fingerprinted, and a
    weight changed between forward and backward is named there."""
    w = torch.randn(8, 8, requires_grad=True)

    def region(x):
        h = x @ w.t()  # t: a view of the weight (printed); mm
        return h.view(-1).sin()  # view: of mm's output (not printed)

    with pytest.raises(RecomputeMismatchError) as caught:
        with recompute_sanitizer() as sanitizer:
            for _ in range(2):  # detected in the first, located in the second
                y = checkpoint(region, torch.randn(4, 8, requires_grad=True),
                               use_reentrant=True).sum()
                with torch.no_grad():
                    w.mul_(2.0)
                y.backward()
    assert sanitizer.ops_compared == 4  # the locator's op stream: t, mm, view, sin
    assert sanitizer.fingerprints == 2 + 6  # detect: the output twice; t, mm and sin twice
    assert caught.value.what == "values" and caught.value.op.startswith("aten.t")
    assert "in region" in caught.value.recompute_site[0]


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_judged_recompute_leaves_nothing_for_the_cycle_collector(early_stop):
    """With the cycle collector off, the recompute's graph and tensors go when backward is done
    (as torch's ``test_nested_checkpoint_early_stop`` asserts): the sanitizer keeps no
    reference cycle through the early-stop exception's frames."""
    import gc
    import weakref

    from torch.utils.checkpoint import set_checkpoint_early_stop

    made: list[weakref.ref] = []
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        h = (x @ w).sin()
        made.append(weakref.ref(h))
        return h.cos()

    gc.collect()
    gc.disable()
    try:
        with recompute_sanitizer(), set_checkpoint_early_stop(early_stop):
            checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
        assert len(made) == 2  # the forward's and the recompute's
        assert [r() is None for r in made] == [True, True]
    finally:
        gc.enable()


def _collector_off():
    """The cycle collector off, after one checkpoint call of each kind: the first call in a
    process imports torch._dynamo, an import that leaves its frames (holding the call's
    arguments) to the collector."""
    import gc

    x = torch.randn(2, 2, requires_grad=True)
    for reentrant in (True, False):
        checkpoint(torch.sin, x, use_reentrant=reentrant).sum().backward()
    gc.collect()
    gc.disable()


@pytest.mark.parametrize("tier", ["detect", "locate"])
def test_a_recompute_judged_different_leaves_nothing_for_the_cycle_collector(tier):
    """The same when the verdict is an error (caught, as a training loop or a test runner
    does): the early-stopped recompute's tensors go with it. ``detect``: a shape difference,
    raised at once by the detect tier; ``locate``: a value difference, raised by the locator's
    op stream on the next round (values="all")."""
    import gc
    import weakref

    made: list[weakref.ref] = []
    w = torch.randn(8, 8, requires_grad=True)
    state = {"n": 8, "scale": 1.0}

    def f(x):
        h = (x @ w)[:, : state["n"]].sin() * state["scale"]
        made.append(weakref.ref(h))
        return h.cos()

    def step():
        y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum()
        state.update(n=4) if tier == "detect" else state.update(scale=state["scale"] + 1)
        y.backward()

    _collector_off()
    try:
        try:
            with recompute_sanitizer(values="none" if tier == "detect" else "all"):
                for _ in range(2):
                    step()
        except CheckpointError as error:  # detect: torch's own, with the sanitizer's note
            if tier == "detect":
                assert "stackfix recompute_sanitizer" in "".join(error.__notes__)
            else:
                assert isinstance(error, RecomputeMismatchError) and error.what == "values"
        else:
            raise AssertionError("no CheckpointError")
        assert len(made) == (2 if tier == "detect" else 4)  # forwards' and recomputes'
        assert [r() is None for r in made] == [True] * len(made)
    finally:
        gc.enable()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_judged_regions_input_goes_with_its_backward_without_the_cycle_collector(reentrant):
    """The region's input (an activation: the chunk view the recompute reclaim lets go of) is
    freed when the backward is done, as without the sanitizer: the walk of the tensors a region
    reaches (judged for writes outside it) leaves no reference cycle holding them. It did, and
    the cycle kept the input's storage until the collector ran (repro shared-view-reclaim under
    every sanitizer: "the shared storage outlived the backward")."""
    import gc

    layer = torch.nn.Linear(8, 8)

    def step() -> int:
        h = torch.randn(4, 16, requires_grad=True) * 2
        y = checkpoint(layer, torch.chunk(h, 2, dim=-1)[1], use_reentrant=reentrant)
        weak = h.untyped_storage()._weak_ref()
        del h
        y.sum().backward()
        return weak

    _collector_off()
    try:
        assert torch.UntypedStorage._expired(step())  # the control: without the sanitizer
        with recompute_sanitizer(values="none") as sanitizer:
            weak = step()
            assert sanitizer.recomputes == 1
            assert torch.UntypedStorage._expired(weak)
    finally:
        gc.enable()


@pytest.mark.parametrize("values", ["all", "none"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_recomputed_layers_input_is_not_held_until_the_backward_ends(reentrant, values):
    """A chain of checkpointed layers: once a layer's backward is done its input (the previous
    layer's output) goes, as without the sanitizer -- the sanitizer's check of writes outside
    the region read its version counters when the recompute ended. It held every layer's
    input (and every parameter) until the backward's end, for the one synchronisation there:
    the backward's peak grew by every checkpointed layer's input."""
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    seen: dict[str, list[bool]] = {}

    def step(name: str) -> None:
        # 128 KiB: above what the sanitizer compares by value (and keeps) as small state
        x = torch.randn(512, 64, requires_grad=True)
        h, inputs = x, []
        for layer in layers:
            inputs.append(weakref.ref(h))
            h = checkpoint(layer, h, use_reentrant=reentrant)
        # when x's gradient arrives, every later layer's backward is done: their inputs gone
        x.register_hook(lambda g: seen.__setitem__(name, [r() is None for r in inputs[1:]]))
        h.sum().backward()

    _collector_off()
    try:
        step("control")
        with recompute_sanitizer(values=values) as sanitizer:
            step("sanitized")
        assert sanitizer.recomputes == 4
    finally:
        gc.enable()
    assert seen["control"] == [True, True, True]
    assert seen["sanitized"] == seen["control"]


@pytest.mark.parametrize("values", ["all", "none"])
def test_a_regions_input_and_its_graph_go_after_backward_without_the_cycle_collector(values):
    """With the cycle collector off, a region's non-leaf input and the graph behind it go once
    backward is done and the caller drops them, as without the sanitizer (torch's nested
    checkpoint tests assert that the graph dies): the walk for the state a region reaches and
    the wrapper on torch's own check keep no reference cycle holding them."""
    import gc
    import weakref

    class Handle:
        pass

    def step(sanitizer) -> weakref.ref:
        x = torch.randn(4, 8, requires_grad=True).sin()
        handle = Handle()
        x.grad_fn.metadata["handle"] = handle  # lives as long as x's graph
        checkpoint(lambda t: t.sin().exp(), x, use_reentrant=False).sum().backward()
        assert sanitizer.recomputes >= 1
        return weakref.ref(handle)

    with recompute_sanitizer(values=values) as sanitizer:
        # a first step with the collector on: what a process does once on its first region
        # (lazy imports; in values="all" one keeps the entering frames, not traced further)
        step(sanitizer)
        gc.collect()
        gc.disable()
        try:
            assert step(sanitizer)() is None
        finally:
            gc.enable()


@pytest.mark.parametrize("change", ["values", "shape"])
def test_a_users_except_checkpoint_error_catches_the_sanitizers_error(change):
    """Where torch's checkpoint raises ``CheckpointError`` (a recompute that saves other
    tensors: nondeterministic, or mutating its input) the sanitizer's error comes first; a
    user's ``except CheckpointError`` must still catch it."""
    from torch.utils.checkpoint import CheckpointError

    w = torch.randn(8, 8, requires_grad=True)
    state = {"n": 4}

    def f(x):
        return (x[: state["n"]] @ w).sin() if change == "shape" else (x @ w * state["n"]).sin()

    with pytest.raises(CheckpointError) as caught, recompute_sanitizer():
        y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum()
        state["n"] = 3
        y.backward()
    # another shape: torch's own check's error, with the sanitizer's as a note (next test)
    assert isinstance(caught.value, RecomputeMismatchError) == (change == "values")


@pytest.mark.parametrize("change", ["count", "shape", "unchecked"])
def test_torchs_own_check_speaks_first_where_it_fails_the_recompute(change):
    """A non-reentrant recompute that saves fewer tensors, or one of another shape, fails
    torch's own check right after it (``check_recomputed_tensors_match``): torch's
    ``CheckpointError`` in its words (PyTorch's ``test_checkpoint_detects_non_determinism``
    matches them) carries the sanitizer's finding (region, call site) as a note. Where torch
    does not check (``determinism_check="none"``) the sanitizer's error is raised."""
    from torch.utils.checkpoint import CheckpointError

    state = {"n": 4, "more": True}

    def f(x):
        h = x[: state["n"]].sin()
        return h.exp().sin() if state["more"] else h.exp()

    kwargs = {"determinism_check": "none"} if change == "unchecked" else {}
    with pytest.raises(CheckpointError) as caught, recompute_sanitizer(values="none"):
        y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False,
                       **kwargs).sum()
        state.update(n=3) if change != "count" else state.update(more=False)
        y.backward()
    if change == "unchecked":
        assert isinstance(caught.value, RecomputeMismatchError)
        return
    assert not isinstance(caught.value, RecomputeMismatchError)
    words = "A different number of tensors" if change == "count" else "different metadata"
    assert words in str(caught.value)
    note, = caught.value.__notes__
    assert "recompute_sanitizer" in note and "test_torchs_own_check_speaks_first" in note


@pytest.mark.parametrize("values", ["all", "none"])
def test_the_forwards_saved_tensors_go_before_backward_as_without_the_sanitizer(values):
    """Non-reentrant checkpointing frees what the region saves once its forward ends; the
    detect tier's pack hook (kept by every saved variable) must not hold them."""
    import weakref

    made: list[weakref.ref] = []
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        h = (x @ w).sin()
        made.append(weakref.ref(h))
        return h.cos()

    with recompute_sanitizer(values=values):
        y = checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum()
        assert made[0]() is None
        y.backward()


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.filterwarnings(_NO_INPUT_REQUIRES_GRAD)
def test_a_reentrant_region_no_input_of_which_requires_grad_is_named_at_its_forward(values,
                                                                                    frozen):
    """Grad on, no input requiring grad: the reentrant checkpoint's output has no grad_fn, the
    region is never recomputed and its parameters get no gradient (a frozen embedding under
    PEFT). Named when its forward ends, with the parameters; all frozen: no error."""
    layer = torch.nn.Linear(8, 8)
    layer.requires_grad_(not frozen)
    x = torch.randn(4, 8)  # no grad: the output of a frozen embedding
    with recompute_sanitizer(values=values):
        if frozen:
            assert not checkpoint(layer, x, use_reentrant=True).requires_grad
            return
        with pytest.raises(RecomputeMismatchError, match="never recomputed") as caught:
            checkpoint(layer, x, use_reentrant=True)
    assert "Linear.weight, Linear.bias" in str(caught.value)
    assert caught.value.verdict == "never recomputed"
    with torch.no_grad(), recompute_sanitizer(values=values):  # grad off: nothing to recompute
        checkpoint(layer, x, use_reentrant=True)


class _FrozenBottom(torch.nn.Module):
    """megatron's ``recompute_method="block"``: the first ``checkpointed`` layers in reentrant
    regions, each a closure over the whole block (``self._get_layer(index)``), the rest run
    plainly."""

    def __init__(self, n: int, checkpointed: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))
        self.checkpointed = checkpointed

    def forward(self, h):
        for i in range(len(self.layers)):
            if i < self.checkpointed:
                h = checkpoint(lambda x, i=i: torch.tanh(self.layers[i](x)), h,
                               use_reentrant=True)
            else:
                h = torch.tanh(self.layers[i](h))
        return h


@pytest.mark.parametrize("values", ["all", "none"])
@pytest.mark.filterwarnings(_NO_INPUT_REQUIRES_GRAD)
def test_a_frozen_bottom_layer_is_judged_by_its_own_parameters_not_the_blocks(values):
    """PEFT-style: the embedding and the bottom (checkpointed) layer frozen, the layers above
    trainable. The bottom region is never recomputed and needs not be: its parameters are
    frozen, the layers above get their gradients. Its closure holds the whole block: read as
    the region's, the trainable layers' parameters made a false "never recomputed" (on real
    megatron too: ``test_sanitize_recompute_real_models``). Narrowed to the modules its
    forward ran, it is silent; a trainable checkpointed layer is still named, by its path."""
    block = _FrozenBottom(3, checkpointed=1)
    block.layers[0].requires_grad_(False)
    x = torch.randn(4, 8)  # a frozen embedding's output
    with recompute_sanitizer(values=values):
        block(x).sum().backward()
    assert all(p.grad is not None for p in block.layers[1:].parameters())
    block = _FrozenBottom(3, checkpointed=2)
    block.layers[0].requires_grad_(False)  # layer 1, checkpointed, gets no gradient
    with pytest.raises(RecomputeMismatchError, match="never recomputed") as caught, \
            recompute_sanitizer(values=values):
        block(x)
    assert caught.value.item == "_FrozenBottom.layers.1.weight, _FrozenBottom.layers.1.bias"


def test_the_module_hook_is_held_only_while_a_regions_forward_runs():
    """What a region's forward ran is recorded by a global forward pre-hook (``_ran``): none is
    registered while the sanitizer is entered with no region's forward running (a module call
    keeps torch's fast path), nor during the recompute."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    seen = []
    before = len(hooks)

    def f(x):
        seen.append(len(hooks))
        return torch.tanh(x)

    for reentrant in (True, False):
        seen.clear()
        with recompute_sanitizer(values="none"):
            assert len(hooks) == before
            y = checkpoint(f, torch.randn(2, requires_grad=True), use_reentrant=reentrant)
            assert len(hooks) == before
            y.sum().backward()
        assert seen == [before + 1, before], (reentrant, seen)  # forward, recompute


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, h):
        self.calls.add_(1)  # counted again by every recompute
        return torch.tanh(self.lin(h))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_write_by_a_layer_whose_forward_is_called_directly_is_seen(reentrant):
    """``model.layer.forward(h)``: the layer is not recorded (no ``__call__``), its linear is;
    the layer between the root and the linear keeps its own state reached (a review of
    cb82629: narrowed to the linear alone, the layer's count went unseen)."""
    model = torch.nn.Module()
    model.layer = _Layer()
    with pytest.raises(RecomputeMismatchError, match="calls"), \
            recompute_sanitizer(values="none"):
        checkpoint(lambda h: model.layer.forward(h), torch.randn(2, 8, requires_grad=True),
                   use_reentrant=reentrant).sum().backward()


def test_a_call_on_another_thread_does_not_narrow_what_a_region_reaches():
    """The region counts into ``model.a`` without calling any module of ``model`` (reached
    whole); meanwhile another thread calls ``model.b``. Recorded as the region's, that call
    narrowed ``model`` to ``b`` and the write went unseen (a review of cb82629)."""
    import threading

    model = torch.nn.Module()
    model.a, model.b = _Layer(), torch.nn.Linear(8, 8)

    def region(h):
        worker = threading.Thread(target=model.b, args=(torch.randn(2, 8),))
        worker.start()
        worker.join()
        model.a.calls.add_(1)
        return torch.tanh(h)

    with pytest.raises(RecomputeMismatchError, match="calls"), \
            recompute_sanitizer(values="none"):
        checkpoint(region, torch.randn(2, 8, requires_grad=True),
                   use_reentrant=False).sum().backward()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_module_built_inside_the_forward_goes_when_the_forward_ends(reentrant):
    """The record holds the modules a region ran weakly: one built inside the forward, with
    its tensors, goes when the forward ends, as without the sanitizer (a review of cb82629:
    held until the backward)."""
    kept = []

    def region(h):
        helper = torch.nn.Linear(8, 8)
        kept.append(weakref.ref(helper.weight))
        return torch.tanh(helper(h).detach() + h)

    with recompute_sanitizer(values="none"):
        y = checkpoint(region, torch.randn(2, 8, requires_grad=True), use_reentrant=reentrant)
        gc.collect()
        assert kept[0]() is None
        y.sum().backward()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_layers_region_reaches_as_many_tensors_however_deep_the_block(monkeypatch,
                                                                       reentrant):
    """Each layer's region holds the whole block (megatron's pattern, ``_Counted``): what it
    reaches is its layer (the modules its forward ran), the same at 2 layers as at 6 -- it
    grew with the block, a step's host time with the square of its depth."""
    from fixes.sanitize import _detect

    sizes: list[int] = []
    reached = _detect.Watch.reached
    monkeypatch.setattr(_detect.Watch, "reached",
                        lambda self: sizes.append(len(list(reached(self)))) or reached(self))
    per_depth = {}
    for n in (2, 6):
        sizes.clear()
        block = _Counted(n, writer=-1)
        with recompute_sanitizer(values="none"):
            block(torch.randn(4, 8, requires_grad=True), reentrant).sum().backward()
        per_depth[n] = set(sizes)
    assert per_depth[2] == per_depth[6] and len(per_depth[2]) == 1, per_depth


class _Dropped(torch.nn.Module):
    """megatron's regions at one call site: each layer's function a new closure each step,
    of one code, with the block and its layer in it; ``drop`` layers skipped this step (the
    regions after them move up in the round); a layer with ``counting`` set counts its calls
    in a buffer of its own (so its recompute counts them again)."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))
        for layer in self.layers:
            layer.register_buffer("calls", torch.zeros(()))
            layer.counting = False
        self.hooks: list[int] = []  # global forward pre-hooks held at each layer call

    def custom(self, i: int):
        block, layer = self, self.layers[i]

        def custom_forward(h):
            assert block.layers[i] is layer
            block.hooks.append(len(torch.nn.modules.module._global_forward_pre_hooks))
            if layer.counting:
                layer.calls.add_(1)
            return torch.tanh(layer(h))

        return custom_forward

    def forward(self, x, reentrant: bool, drop=()):
        for i in range(len(self.layers)):
            if i not in drop:
                x = checkpoint(self.custom(i), x, use_reentrant=reentrant)
        return x


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_a_region_records_the_modules_its_forward_runs_once_while_the_record_holds(
        values, reentrant):
    """Recording the modules a region's forward runs (``_ran``) holds a global module hook,
    which puts every module call of the forward on torch's slow path (a third of
    ``values="none"``'s Python calls a region on megatron's MoE). In ``sampled`` and ``none``
    a region of the same identity -- call site, position, its function's code and closure --
    takes the record made lately (``_reach.Walks.ran``): the hook is held in the first step
    alone; ``all`` records every forward."""
    block = _Dropped(3)
    steps = []
    with recompute_sanitizer(values=values) as sanitizer:
        for _ in range(4):
            block.hooks.clear()
            block(torch.randn(4, 8, requires_grad=True), reentrant).sum().backward()
            steps.append(max(block.hooks))
    if values == "all":
        assert steps == [1, 1, 1, 1]
    else:
        assert steps == [1, 0, 0, 0] and sanitizer._walks.recorded == 3


class _Counts(torch.nn.Module):
    """A module whose forward counts its calls in a buffer of its own (its recompute counts
    them again: a write outside the region)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, h):
        self.calls.add_(1)
        return h


class _PerCall(_Dropped):
    """``_Dropped`` whose layers' functions also run a module made anew by each call (as
    megatron's softmax is)."""

    def custom(self, i: int):
        layer = self.layers[i]

        def custom_forward(h):
            if layer.counting:
                layer.calls.add_(1)
            return torch.nn.Tanh()(layer(h))

        return custom_forward


@pytest.mark.parametrize("block_type", [_Dropped, _PerCall], ids=["same", "a module per call"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_values_all_takes_its_identitys_plan_while_its_forward_runs_the_same_modules(
        monkeypatch, reentrant, block_type):
    """``all`` records the modules every forward runs; where its identity's last record listed
    the same ones (alive, in order, no registration since), what the function reaches is the
    plan made from that record (``_reach._Plan``), not found again through its closure and
    narrowed: those were a quarter of ``all``'s reach on the H200's host
    (``benchmarks/results/evidence/2026-12-06-h200-sanitizer-profile/``). The kept walk is
    still checked once a round, so it still finds what a fresh walk would."""
    from fixes.sanitize import _reach

    calls = []
    narrowed = _reach.narrowed
    monkeypatch.setattr(_reach, "narrowed", lambda *a: calls.append(1) or narrowed(*a))
    block = block_type(3)
    with recompute_sanitizer(values="all"):
        for step in range(4):
            block(torch.randn(4, 8, requires_grad=True), reentrant).sum().backward()
            assert len(calls) == 3, step  # the first step's three regions made the plans
        block.layers[2].counting = True  # the recompute counts again: still caught
        with pytest.raises(RecomputeMismatchError, match=r"side effect.*custom_forward"):
            block(torch.randn(4, 8, requires_grad=True), reentrant).sum().backward()
            block(torch.randn(4, 8, requires_grad=True), reentrant).sum().backward()


@pytest.mark.parametrize("change", ["deleted, another runs in its place",
                                    "put in without a hook"])
def test_values_all_sees_a_module_run_after_a_change_no_hook_sees(change):
    """``all`` reaches what a fresh walk would each step: after ``del net.b`` (``net.c``, a
    counting module, runs in its place) or a module put in through ``_modules`` (as
    ``torch.ao.quantization``'s convert does), the counting module's recompute is caught in
    the step of the change or the next. A record kept across the change (a freed module
    taken to match any, f30d70f) or a tree kept while its paths held (653dbf1) missed it
    for ``REWALK_ROUNDS`` steps (a review of both; reverted)."""
    import gc

    net = torch.nn.Module()
    net.a = torch.nn.Linear(8, 8)
    net.b = torch.nn.Identity()
    counting = _Counts()
    swapped_out = net.b  # the swap keeps it alive: no freed tensor marks the kept walk
    if change.startswith("deleted"):
        net.c = counting
        del swapped_out

    def body(h):
        h = net.a(h)
        return torch.tanh(net.b(h) if hasattr(net, "b") else net.c(h))

    caught = None
    with pytest.raises(RecomputeMismatchError), recompute_sanitizer(values="all"):
        for step in range(6):
            caught = step
            if step == 2:
                if change.startswith("deleted"):
                    del net.b
                    gc.collect()
                else:
                    net._modules["b"] = counting
            checkpoint(body, torch.randn(4, 8, requires_grad=True),
                       use_reentrant=False).sum().backward()
    assert caught <= 3


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("values", ["sampled", "none"])
def test_a_lent_record_is_the_regions_own_when_the_layers_before_it_are_skipped(
        values, reentrant):
    """The record a region is lent is its own layer's, told apart by what its closure holds,
    not by its position alone: with the first layer skipped from the third step on, the
    third layer's region sits where the second's did; lent the second's record, it reached
    the second layer and its recompute's count, begun at the fourth step, went unseen."""
    block = _Dropped(3)
    with pytest.raises(RecomputeMismatchError, match=r"layers\.2\.calls"), \
            recompute_sanitizer(values=values) as sanitizer:
        for step in range(5):
            block.layers[2].counting = step >= 3
            block(torch.randn(4, 8, requires_grad=True), reentrant,
                  drop=(0,) if step >= 2 else ()).sum().backward()
    assert float(block.layers[2].calls) == 1.0  # the forward's count: the recompute's undone
    assert sanitizer._walks.recorded == 5  # 3 in the first step, 2 moved up in the third


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("values", ["sampled", "none"])
def test_a_plan_that_outlives_the_walk_it_shares_makes_the_walk_again(values, reentrant):
    """Two functions reaching no module share one kept walk (of nothing); the second, first
    run later, keeps its record of the modules run and the plan made from it past the walk's
    ``REWALK_ROUNDS``: the walk is made again from the plan (it raised ``UnboundLocalError``
    out of the user's backward once -- PyTorch's nested-checkpoint tests found it)."""
    from fixes.sanitize._reach import REWALK_ROUNDS

    x = torch.randn(3, requires_grad=True)
    with recompute_sanitizer(values=values) as sanitizer:
        for step in range(REWALK_ROUNDS + 4):
            y = checkpoint(lambda t: torch.sin(t) * 2, x, use_reentrant=reentrant)
            if step >= 3:
                y = checkpoint(lambda t: torch.cos(t) * 2, y, use_reentrant=reentrant)
            y.sum().backward()
    assert sanitizer._walks.walked >= 2 and not sanitizer.internal_errors


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("values", ["sampled", "none"])
@pytest.mark.parametrize("held", ["a list changed in place", "a new list each step"])
def test_what_a_function_reaches_through_a_list_is_found_anew(values, reentrant, held):
    """A function whose closure holds a list of modules (changed in place, or a new one each
    step whose id the old one's may be): its identity is the same while the modules it
    reaches are not. Planned once (what it reached kept per identity), the module put in at
    the third step, whose forward counts its calls, went unseen (a review of 628638c)."""
    a, b = torch.nn.Linear(8, 8), _Layer()  # b counts its calls
    chosen = [a]

    def run_inplace(h):
        for m in chosen:
            h = m(h)
        return h

    def make(mods):
        def run(h):
            for m in mods:
                h = m(h)
            return h
        return run

    with pytest.raises(RecomputeMismatchError, match=r"calls"), \
            recompute_sanitizer(values=values):
        for step in range(4):
            pick = a if step < 2 else b
            chosen[0] = pick
            fn = run_inplace if held == "a list changed in place" else make([pick])
            checkpoint(fn, torch.randn(4, 8, requires_grad=True),
                       use_reentrant=reentrant).sum().backward()


@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_a_meta_view_a_region_reaches_is_left_unread(values):
    """A meta tensor at an offset has a data pointer of its offset and a storage of its bytes:
    read from its signature as readable, its snapshot went to the device "meta" and the
    backward's flush raised out of the user's backward (a review of c7bca23)."""
    lin = torch.nn.Linear(4, 4)
    lin.register_buffer("placeholder", torch.empty(10, device="meta")[2:])
    with recompute_sanitizer(values=values) as sanitizer:
        for _ in range(2):
            checkpoint(lin, torch.randn(2, 4, requires_grad=True),
                       use_reentrant=False).sum().backward()
    assert not sanitizer.internal_errors


@pytest.mark.parametrize("values", ["sampled", "none"])
def test_a_record_is_made_again_after_a_module_is_registered(values):
    """A registration anywhere (torch's global registration hooks) may change what a
    region's forward runs: its identity's next region records again."""
    block = _Dropped(2)
    with recompute_sanitizer(values=values) as sanitizer:
        for step in range(3):
            if step == 2:
                block.layers[1].extra = torch.nn.Identity()
            block(torch.randn(4, 8, requires_grad=True), False).sum().backward()
    assert sanitizer._walks.recorded == 4


def test_a_compiled_module_inside_a_region_is_not_compiled_again_by_the_module_hook():
    """The module hook (``_ran``) is registered at each region's forward and removed after: a
    ``torch.compile``d module called inside reuses its graph (no recompile on the hook's
    coming and going); torch warns that global hooks fire twice for it (the record counts
    each module once)."""
    import warnings

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lin = torch.nn.Linear(8, 8)
    inner = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
                          backend="eager")

    def region(x):
        return inner(lin(x))

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()  # compiled without the hook
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recompute_sanitizer(values="none") as sanitizer:
            for _ in range(4):
                checkpoint(region, x, use_reentrant=False).sum().backward()
    assert sanitizer.recomputes == 4 and counters["frames"]["total"] == 1
    assert not counters["recompiles"]
    assert any("global hooks on modules" in str(w.message) for w in caught)
    torch._dynamo.reset()


def test_a_backward_flushes_its_checks_once_whatever_its_regions(monkeypatch):
    """Each recompute's check is queued for the end of its backward; one callback flushes them
    all (four regions: one flush, not four), and a backward that failed before its callbacks
    ran leaves its checks to the next backward's flush."""
    from fixes.sanitize.recompute import RecomputeSanitizer

    flushed = []
    flush = RecomputeSanitizer._flush
    monkeypatch.setattr(RecomputeSanitizer, "_flush",
                        lambda self: flushed.append(len(self._pending)) or flush(self))
    layers = [torch.nn.Linear(4, 4) for _ in range(4)]

    def forward(x):
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x.sum()

    with recompute_sanitizer(values="none") as sanitizer:
        forward(torch.randn(2, 4, requires_grad=True)).backward()
        assert flushed == [4] and sanitizer.recomputes == 4

        class Fail(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                raise RuntimeError("a failing backward")

        y = forward(Fail.apply(torch.randn(2, 4, requires_grad=True)))
        with pytest.raises(RuntimeError, match="a failing backward"):
            y.backward()
        forward(torch.randn(2, 4, requires_grad=True)).backward()
    assert flushed[0] == 4 and sum(flushed) == 12 and sanitizer.recomputes == 12


def test_a_recompute_in_a_callback_after_the_flush_is_judged_in_its_own_backward():
    """A final callback queued after the sanitizer's flush (one that reads a checkpointed
    region's saved tensor) recomputes that region: its check is flushed with that backward,
    not left to a later one that would take a legitimate write after the backward for the
    recompute's (a review of fd11831, whose one-callback-a-backward did exactly that)."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))  # small state: compared by its bits

        def forward(self, x):
            return self.lin(x) * self.scale

    first, second = torch.nn.Linear(4, 4), Scaled()
    with recompute_sanitizer(values="none") as sanitizer:
        x = torch.randn(2, 4, requires_grad=True)
        y = checkpoint(first, x, use_reentrant=False)
        z = checkpoint(second, y.detach().requires_grad_(), use_reentrant=False)
        x.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(
            lambda: z.grad_fn._saved_other))
        y.sum().backward()
        assert sanitizer.recomputes == 2 and sanitizer._pending == []
        with torch.no_grad():
            second.scale.fill_(2.0)  # a schedule's update, after the backward
    assert torch.equal(second.scale, torch.full((4,), 2.0))


class _Counted(torch.nn.Module):
    """megatron's pattern: each layer's region holds the whole block (its closure reaches
    every layer's buffers); one layer's forward counts its calls in a buffer of its own, so
    its recompute counts them again (torchtitan #4568's token counts)."""

    def __init__(self, n: int, writer: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))
        for layer in self.layers:
            layer.register_buffer("calls", torch.zeros(()))
        self.writer = writer

    def region(self, i: int):
        block, layer = self, self.layers[i]

        def counted_layer(h):
            assert block.layers[i] is layer  # the whole block in the closure, as megatron's
            layer.calls.add_(1)
            return torch.tanh(layer(h))

        def plain_layer(h):
            assert block.layers[i] is layer
            return torch.tanh(layer(h))

        return counted_layer if i == self.writer else plain_layer

    def forward(self, x, reentrant: bool):
        for i in range(len(self.layers)):
            x = checkpoint(self.region(i), x, use_reentrant=reentrant)
        return x


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("values", ["all", "sampled", "none"])
def test_a_write_is_named_for_the_recompute_that_made_it_not_one_before(values, reentrant):
    """Backward recomputes the last layer first; the first layer's recompute writes. The
    regions recomputed before it reach the same buffer, and a snapshot compared at the
    backward's end took the write for theirs: the first of them was named, and ``all``'s
    locator, replaying it, found nothing ("did not recur"). Each recompute is judged by what
    it left, when it ends: the writer is named, and ``all`` names its op."""
    block = _Counted(3, writer=0)
    with pytest.raises(RecomputeMismatchError) as caught, \
            recompute_sanitizer(values=values) as sanitizer:
        for _ in range(2):
            block(torch.randn(4, 8, requires_grad=True), reentrant).sum().backward()
    message = str(caught.value)
    assert "counted_layer" in message and "plain_layer" not in message
    assert caught.value.verdict.name == "SIDE_EFFECT"
    if values == "all":
        assert sanitizer.located == 1 and caught.value.op == "aten.add_.Tensor"
        assert "did not recur" not in message
    assert float(block.layers[0].calls) == (2.0 if values == "all" else 1.0)


@pytest.mark.parametrize("values", ["all", "none"])
def test_a_tensor_two_recomputes_wrote_gets_its_contents_from_before_the_first(values):
    """Two layers' regions count into one buffer of their block; each recompute counts again.
    The contents given back are those from before the first recompute that wrote it (2 after
    two forwards), not the later one's before, which still held the first's extra count."""
    block = torch.nn.Module()
    block.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
    block.register_buffer("calls", torch.zeros(()))

    def region(layer):
        def counted(h):
            block.calls.add_(1)
            return torch.tanh(layer(h))
        return counted

    with pytest.raises(RecomputeMismatchError):
        with recompute_sanitizer(values=values):
            x = torch.randn(4, 8, requires_grad=True)
            for layer in block.layers:
                x = checkpoint(region(layer), x, use_reentrant=True)
            x.sum().backward()
            assert float(block.calls) == 2.0  # all: both found, located on a next round
    assert float(block.calls) == 2.0


def test_a_write_is_judged_undeclared_by_the_blocks_entered_during_its_own_recompute():
    """A declared block (``recompute_may_differ``) entered by a later region's recompute does
    not make an earlier region's undeclared write a declared one: what was entered is read
    when each recompute ends (a review of ee39c4f: read at the backward's end)."""
    from fixes.sanitize import recompute_may_differ

    block = _Counted(3, writer=1)

    def region(i):
        if i != 0:
            return _Counted.region(block, i)

        def declaring_layer(h):
            with recompute_may_differ("a stash put back"):
                pass
            return torch.tanh(block.layers[0](h))
        return declaring_layer

    block.region = region
    with pytest.raises(RecomputeMismatchError, match="counted_layer"), \
            recompute_sanitizer(values="none"):
        block(torch.randn(4, 8, requires_grad=True), False).sum().backward()


def test_a_hook_registered_before_the_step_that_writes_reached_state_is_no_difference():
    """A grad hook registered once (at init) counts into a buffer the region reaches while the
    backward runs -- after the recompute ended: not the recompute's write (compared at the
    backward's end, it was taken for one)."""
    lin = torch.nn.Linear(8, 8)
    lin.register_buffer("grad_calls", torch.zeros(()))
    lin.weight.register_hook(lambda g: lin.grad_calls.add_(1) and None)
    for reentrant in (False, True):
        with recompute_sanitizer(values="none") as sanitizer:
            checkpoint(lambda h: torch.tanh(lin(h)), torch.randn(4, 8, requires_grad=True),
                       use_reentrant=reentrant).sum().backward()
        assert sanitizer.recomputes == 1 and sanitizer.detections == 0


def test_a_failure_of_the_snapshot_at_the_recompute_end_is_the_sanitizers_own(monkeypatch):
    """``settle`` copies (it allocates, mid-backward): its failure is the sanitizer's own --
    a warning, the region unchecked -- not the user's backward's."""
    from fixes.sanitize import RecomputeSanitizerWarning, _reach

    def fails(self, device):
        raise torch.OutOfMemoryError("simulated: the copy at the recompute's end")

    monkeypatch.setattr(_reach.State, "_now", fails)
    lin = torch.nn.Linear(4, 4)
    lin.register_buffer("b", torch.zeros(4))
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(RecomputeSanitizerWarning, match="simulated"), \
            recompute_sanitizer(values="none"):
        checkpoint(lambda h: lin(h), x, use_reentrant=False).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("values", ["all", "none"])
def test_a_write_outside_the_region_names_the_tensor_where_the_region_holds_it(values):
    """The detect tier's finding names the buffer by its path from the outermost module the
    region holds (``_Counted.layers.0.calls``), not only its shape: a newcomer's pass found
    "a tensor outside the region (shape [], float32)" not enough to act on. ``all`` with one
    step raises it when the sanitizer exits (no next round to locate it in)."""
    block = _Counted(3, writer=0)
    with pytest.raises(RecomputeMismatchError) as caught, recompute_sanitizer(values=values):
        block(torch.randn(4, 8, requires_grad=True), True).sum().backward()
    assert "_Counted.layers.0.calls" in str(caught.value)
    assert "would have located it" not in str(caught.value)


@pytest.mark.parametrize("inputs_require_grad", [True, False])
@pytest.mark.filterwarnings(_NO_INPUT_REQUIRES_GRAD)
def test_a_reentrant_regions_forward_is_recorded_once(monkeypatch, inputs_require_grad):
    """A reentrant region's forward opens one recording of the modules it runs (``_ran``), the
    Watch's, which the never-recomputed check reads too: a second one around it paid the
    lock, the hook's registration and the record's slice again on every megatron layer."""
    from fixes.sanitize._ran import ModulesRun

    opened = []
    recording = ModulesRun.recording
    monkeypatch.setattr(ModulesRun, "recording",
                        lambda self: opened.append(1) or recording(self))
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=inputs_require_grad)
    with recompute_sanitizer(values="none"):
        if inputs_require_grad:
            checkpoint(layer, x, use_reentrant=True).sum().backward()
        else:
            with pytest.raises(RecomputeMismatchError, match=r"Linear\.weight"):
                checkpoint(layer, x, use_reentrant=True)
    assert len(opened) == 1


@pytest.mark.filterwarnings(_NO_INPUT_REQUIRES_GRAD)
def test_a_region_never_recomputed_is_named_on_the_round_the_locator_runs():
    """Step 1's recompute differs: ``all`` arms the locator for the call site's next round.
    In step 2 that region (the locator's, which records no modules of its own) gets inputs
    that need no grad: it is never recomputed, and still named by the parameters of the
    layer it ran, not the whole block its closure holds."""
    state = {"scale": 1.0}
    block = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def f(x):
        return block[0](x) * state["scale"]

    with pytest.raises(RecomputeMismatchError, match="never recomputed") as caught, \
            recompute_sanitizer(values="all") as sanitizer:
        for step in range(2):
            state["scale"] = 1.0
            y = checkpoint(f, torch.randn(4, 8, requires_grad=step == 0),
                           use_reentrant=True).sum()
            state["scale"] = 2.0
            y.backward()
    assert sanitizer.located == 1
    assert caught.value.item == "ModuleList.0.weight, ModuleList.0.bias"
