"""An update of a buffer inside a checkpointed region, applied again by its recompute
(torchtitan #4568 / #4622: effectful ops must not run twice under activation checkpointing).

An MoE router counts the tokens it sends to each expert in a buffer (``tokens_per_expert``, as
aux-loss-free load balancing does; the counts steer the next step's expert bias). The count is
an in-place add inside the layer's forward, so under activation checkpointing the recompute in
``backward()`` adds the same counts a second time: after one step every count is doubled.
Nothing raises; the balancing is silently steered by wrong numbers.

The model here, plain torch: two router + expert layers, each checkpointed (non-reentrant);
after one forward + backward the buffers are compared with the same model without
checkpointing:

- unfixed: plain checkpoint -> every count doubled -> ``WrongResult``;
- under ``fixes.sanitize.recompute_sanitizer()``: ``RecomputeMismatchError`` naming the
  recompute's ``add_`` into the buffer, which the recompute left changed (a replayed side
  effect; the sanitizer gives the buffer its contents from before the recompute back);
- fixed: the buffer captured per region, ``fixes.recompute.state_preserving_context_fn`` ->
  the recompute starts from the forward's counts and its own update is undone -> the counts of
  the reference, and the same gradients.

Run one side by hand: ``python -m repro.child recompute-side-effect --unfixed``.
"""

from __future__ import annotations

import torch
from torch import nn

from repro.registry import Repro, Signature, WrongResult

DIM, TOKENS, EXPERTS, LAYERS, SEED = 16, 32, 4, 2, 0


class CountingMoE(nn.Module):
    """Top-1 router whose forward adds its per-expert token counts to a buffer."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.router = nn.Parameter(torch.randn(DIM, EXPERTS, generator=generator) / DIM**0.5)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM, generator=generator) / DIM)
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(x @ self.router, dim=-1)
        weight, expert = probs.max(dim=-1)
        with torch.no_grad():
            self.tokens_per_expert.add_(torch.bincount(expert, minlength=EXPERTS))
        out = torch.einsum("td,tde->te", x, self.experts[expert])
        return x + weight.unsqueeze(-1) * out


def _step(checkpointing: bool, fixed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from torch.utils.checkpoint import checkpoint

    from fixes.recompute import state_preserving_context_fn

    g = torch.Generator().manual_seed(SEED)
    layers = nn.ModuleList(CountingMoE(g) for _ in range(LAYERS))
    h = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(SEED + 1))
    for layer in layers:
        if not checkpointing:
            h = layer(h)
            continue
        kwargs = {}
        if fixed:
            kwargs["context_fn"] = state_preserving_context_fn((layer, "tokens_per_expert"))
        h = checkpoint(layer, h, use_reentrant=False, **kwargs)
    h.pow(2).mean().backward()
    return ([layer.tokens_per_expert.clone() for layer in layers],
            [p.grad for p in layers.parameters()])


def run(fixed: bool, device: str) -> None:
    if device != "cpu":
        raise ValueError(f"recompute-side-effect runs on CPU; got device={device!r}")
    ref_counts, ref_grads = _step(checkpointing=False, fixed=False)
    counts, grads = _step(checkpointing=True, fixed=fixed)
    print(f"SIDE-EFFECT counts {[c.tolist() for c in counts]} "
          f"(reference {[c.tolist() for c in ref_counts]})", flush=True)
    if any(not torch.equal(a, b) for a, b in zip(counts, ref_counts, strict=True)):
        raise WrongResult(
            f"tokens_per_expert after one step differs from the no-checkpoint reference: "
            f"{[c.tolist() for c in counts]} vs {[c.tolist() for c in ref_counts]} (the "
            "recompute added its counts again)")
    if any(not torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)):
        raise WrongResult("gradients differ from the no-checkpoint reference")


REPROS = [
    Repro(
        name="recompute-side-effect",
        summary="a buffer updated in a checkpointed region (MoE tokens-per-expert) is updated "
        "again by the recompute: counts silently doubled",
        run=run,
        signatures=(Signature(exception="WrongResult", message="tokens_per_expert after one "
                              "step differs"),),
        sanitized_signatures=(Signature(exception="RecomputeMismatchError",
                                        message="(side effect): a tensor outside the "
                                        "region"),),
        sanitizers=("storage", "recompute"), devices=("cpu",), timeout=120.0,
        upstream="torchtitan #4568 / #4622",
    ),
]
