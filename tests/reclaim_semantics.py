"""What whoever touches a checkpoint's recompute input sees, with the reclaim and with megatron's
own backward (issue 39; imported by tests/test_reclaim_value_safety.py and, for CUDA, by its
child interpreters). Four classes, each a few scenarios run twice in one process, the reclaim
removed and installed:

- ``autocast``: an fp32 input used by two matmuls under autocast -- inside the checkpointed
  function, or around forward and backward. autocast caches the cast of a leaf that requires
  grad only, so megatron's detached copy is cast once and its two gradients meet in bf16.
- ``grad``: the input's ``.grad``: ``retain_grad()`` on it and a kept graph backwarded after the
  main backward; an auxiliary ``backward()`` inside the recompute followed by ``x.grad = None``;
  a ``.grad`` set before the recompute uses the input.
- ``inplace``: in-place writes megatron refuses before they land (its copy is a leaf that
  requires grad): on a Parameter passed as a checkpoint input, on a slice input, on a kept input
  after the backward (and one it allows: the same write under ``no_grad``).
- ``errors``: ``copy.deepcopy`` of a module caching its recompute input (an EMA copy) or its
  recompute output, ``requires_grad_()`` toggles on the input, an ``if x.is_leaf: x = x.clone()``
  branch followed by an in-place op, and a walk of a leaked recompute graph reading its leaves.

``verdict(name, target, device)``: ``same`` (every value, bitwise, and every error text equal to
megatron's own backward's), ``named: <error>`` (the reclaim's run raised an error that names the
reclaim and how to remove it), or ``WRONG: <what>``. ``target``: ``"torch"`` (PyTorch's reentrant
checkpoint) or ``"megatron"`` (megatron-core's ``tensor_parallel.checkpoint``).
"""

from __future__ import annotations

import copy

import torch
from reclaim_readers import _target  # the checkpoint call, torch's or megatron's, reclaim on/off
from torch import nn

WAY_OUT = "fixes.megatron.remove_recompute_reclaim_patch"


def _error(fn) -> str:
    """``""`` if ``fn()`` runs, else the error's type and text."""
    try:
        fn()
    except (RuntimeError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _randn(*shape, device, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device).requires_grad_(requires_grad)


def _grads(**tensors) -> dict:
    return {f"{n}.grad": None if t.grad is None else t.grad.detach().clone()
            for n, t in tensors.items()}


# --- 1. autocast's cast cache ----------------------------------------------------------------


def _two_matmuls(device):
    h = _randn(32, 64, device=device, requires_grad=True)
    w1 = nn.Parameter(_randn(64, 64, device=device, seed=1))
    w2 = nn.Parameter(_randn(64, 64, device=device, seed=2))
    return h, w1, w2


def autocast_inside(checkpoint, device):
    h, w1, w2 = _two_matmuls(device)

    def f(x):
        with torch.autocast(device, dtype=torch.bfloat16):
            return (x @ w1).tanh() + x @ w2  # x cast once (megatron's leaf) or twice

    checkpoint(f, h * 1.0).float().square().sum().backward()
    return _grads(h=h, w1=w1, w2=w2)


def autocast_around(checkpoint, device):
    h, w1, w2 = _two_matmuls(device)
    with torch.autocast(device, dtype=torch.bfloat16):  # the recompute runs in it too
        out = checkpoint(lambda x: (x @ w1).tanh() + x @ w2, h * 1.0)
        out.float().square().sum().backward()
    return _grads(h=h, w1=w1, w2=w2)


# --- 2. the input's .grad --------------------------------------------------------------------


def _layer(device):
    h = _randn(4, 8, device=device, requires_grad=True)
    w = nn.Parameter(_randn(8, device=device, seed=1))
    return h, w


def grad_retained_and_backwarded_again(checkpoint, device):
    h, w = _layer(device)
    kept = []

    def f(x):
        if torch.is_grad_enabled():  # the recompute (the checkpointed forward runs in no_grad)
            x.retain_grad()
            kept.append((x, (x * 3.0).sum()))  # a side term, backwarded after the main backward
        return (x * w).tanh()

    checkpoint(f, h * 1.0).sum().backward()
    x, side = kept[0]
    side.backward()
    return {"x.grad": x.grad.clone(), **_grads(h=h, w=w)}


def grad_of_an_auxiliary_backward_dropped(checkpoint, device):
    h, w = _layer(device)

    def f(x):
        if torch.is_grad_enabled():
            (x * 3.0).sum().backward()  # an auxiliary backward inside the recompute
            x.grad = None
        return (x * w).tanh()

    checkpoint(f, h * 1.0).sum().backward()
    return _grads(h=h, w=w)


def grad_set_before_the_recompute_uses_it(checkpoint, device):
    h, w = _layer(device)

    def f(x):
        if torch.is_grad_enabled():
            x.grad = torch.full_like(x, 0.5)
        return (x * w).tanh()

    checkpoint(f, h * 1.0).sum().backward()
    return _grads(h=h, w=w)


# --- 3. in-place writes ----------------------------------------------------------------------


def inplace_on_a_parameter_input(checkpoint, device):
    h, _ = _layer(device)
    w = nn.Parameter(_randn(8, 8, device=device, seed=1))

    def f(x, weight):
        if torch.is_grad_enabled():
            weight.mul_(0.5)  # megatron's copy of w is a leaf that requires grad: refused
        return (x @ weight).tanh()

    out = checkpoint(f, h * 1.0, w)
    return {"error": _error(lambda: out.sum().backward()), "w": w.detach().clone(),
            **_grads(h=h)}


def inplace_on_a_slice_input(checkpoint, device):
    h, w = _layer(device)
    base = h * 1.0

    def f(x):
        if torch.is_grad_enabled():
            x.mul_(2.0)
        return (x * w[:4]).tanh()

    out = checkpoint(f, base[:, :4])
    return {"error": _error(lambda: out.sum().backward()), "base": base.detach().clone()}


def _kept_input(checkpoint, device):
    h, w = _layer(device)
    inp, kept = h * 1.0, []

    def f(x):
        if torch.is_grad_enabled():
            kept.append(x)
        return (x * w).tanh()

    checkpoint(f, inp).sum().backward()
    return inp, kept[0], h, w


def inplace_on_a_kept_input_after_the_backward(checkpoint, device):
    inp, x, h, w = _kept_input(checkpoint, device)
    return {"error": _error(lambda: x.mul_(2.0)), "inp": inp.detach().clone(),
            "x": x.detach().clone(), **_grads(h=h, w=w)}


def no_grad_write_on_a_kept_input_after_the_backward(checkpoint, device):
    inp, x, h, w = _kept_input(checkpoint, device)
    with torch.no_grad():
        x.mul_(2.0)  # allowed by megatron: it lands in the input's storage
    return {"inp": inp.detach().clone(), "x": x.detach().clone(), "x.grad": x.grad.clone(),
            **_grads(h=h, w=w)}


# --- 4. what raises --------------------------------------------------------------------------


class _Caching(nn.Module):
    """Keeps its recompute input or output (an EMA / logging tool deep-copies the module)."""

    def __init__(self, device, keep: str):
        super().__init__()
        self.w = nn.Parameter(_randn(8, device=device, seed=1))
        self.keep = keep
        self.last = None

    def forward(self, x):
        out = (x * self.w).tanh()
        if torch.is_grad_enabled():
            self.last = x if self.keep == "input" else out
        return out


def _deepcopy_of_a_module_caching(keep: str):
    def scenario(checkpoint, device):
        h, _ = _layer(device)
        module = _Caching(device, keep)
        checkpoint(module, h * 1.0).sum().backward()
        copied = []
        error = _error(lambda: copied.append(copy.deepcopy(module)))
        last = {} if error else {"copy.last": copied[0].last.detach().clone()}
        return {"error": error, **last, **_grads(h=h, w=module.w)}

    return scenario


def requires_grad_toggled_on_the_input(checkpoint, device):
    h, w = _layer(device)

    def f(x):
        y = 0.0
        if torch.is_grad_enabled():
            x.requires_grad_(False)
            y = x * 2.0  # a term without a gradient to x
            x.requires_grad_(True)
        return (x * w).tanh() + y

    checkpoint(f, h * 1.0).sum().backward()
    return _grads(h=h, w=w)


def clone_if_leaf_then_in_place(checkpoint, device):
    h, w = _layer(device)

    def f(x):
        if x.is_leaf:
            x = x.clone()
        x.mul_(2.0)
        return (x * w).tanh()

    out = checkpoint(f, h * 1.0)
    return {"error": _error(lambda: out.sum().backward()), **_grads(h=h, w=w)}


def walk_of_a_leaked_graph(checkpoint, device):
    """The Megatron-LM #3221 / #5227 leak (the module keeps a recompute intermediate); a tool
    then walks that graph and reads every non-parameter leaf it reaches."""
    h, w = _layer(device)
    leaked = []

    def f(x):
        out = (x * w).tanh()
        if torch.is_grad_enabled():
            leaked.append(out)
        return out

    checkpoint(f, h * 1.0).sum().backward()
    values = []
    stack = [leaked[0].grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        variable = getattr(node, "variable", None)
        if variable is not None and not isinstance(variable, nn.Parameter):
            values.append(variable.detach().clone())
        stack.extend(fn for fn, _ in node.next_functions)
    return {"leaves": torch.stack(values)}


SCENARIOS = {
    "autocast": {"inside": autocast_inside, "around": autocast_around},
    "grad": {
        "retained-and-backwarded-again": grad_retained_and_backwarded_again,
        "auxiliary-backward-dropped": grad_of_an_auxiliary_backward_dropped,
        "set-before-the-recompute": grad_set_before_the_recompute_uses_it,
    },
    "inplace": {
        "parameter-input": inplace_on_a_parameter_input,
        "slice-input": inplace_on_a_slice_input,
        "kept-input-after-backward": inplace_on_a_kept_input_after_the_backward,
        "kept-input-after-backward-no-grad": no_grad_write_on_a_kept_input_after_the_backward,
    },
    "errors": {
        "deepcopy-caching-input": _deepcopy_of_a_module_caching("input"),
        "deepcopy-caching-output": _deepcopy_of_a_module_caching("output"),
        "requires-grad-toggled": requires_grad_toggled_on_the_input,
        "clone-if-leaf-then-in-place": clone_if_leaf_then_in_place,
        "walk-of-a-leaked-graph": walk_of_a_leaked_graph,
    },
}


def run(kind: str, name: str, target: str, device: str, reclaim: bool) -> dict | str:
    """What the scenario saw, or the text of an error it did not catch itself."""
    with _target(target, reclaim, device) as checkpoint:
        try:
            return SCENARIOS[kind][name](checkpoint, device)
        except (RuntimeError, TypeError, AttributeError) as e:
            return f"{type(e).__name__}: {e}"


def _names_the_reclaim(text: str) -> bool:
    return "stackfix" in text and WAY_OUT in text


def _blames_megatron(text: str) -> bool:
    return "megatron" in text.lower() and "refuse" in text.lower()


def verdict(kind: str, name: str, target: str, device: str) -> str:
    reference = run(kind, name, target, device, reclaim=False)
    got = run(kind, name, target, device, reclaim=True)
    errors = [got] if isinstance(got, str) else [v for v in got.values() if isinstance(v, str)]
    named = [e for e in errors if e and _names_the_reclaim(e)]
    if named:
        refused = isinstance(reference, str) or any(
            isinstance(v, str) and v for v in reference.values())
        if _blames_megatron(named[0]) and not refused:
            return f"WRONG: blames megatron, which runs it: {named[0]}"
        return f"named: {named[0]}"
    if isinstance(reference, str) or isinstance(got, str) or reference.keys() != got.keys():
        return "same" if reference == got else f"WRONG: {got!r} instead of {reference!r}"
    wrong = []
    for key, ref in reference.items():
        value = got[key]
        if isinstance(ref, torch.Tensor) and isinstance(value, torch.Tensor):
            equal = ref.dtype == value.dtype and torch.equal(ref, value)
        else:
            equal = ref == value
        if not equal:
            wrong.append(f"{key}: {_short(value)} instead of {_short(ref)}")
    return "WRONG: " + "; ".join(wrong) if wrong else "same"


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.flatten()[:3].tolist()} (sum {value.double().sum().item():.6g})"
    return repr(value)[:300]


def verdicts(kind: str, target: str, device: str) -> dict[str, str]:
    return {name: verdict(kind, name, target, device) for name in SCENARIOS[kind]}
