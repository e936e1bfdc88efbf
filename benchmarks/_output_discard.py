"""``CheckpointWithoutOutput``'s output discard: the memory of one training step with selective
"layernorm" recompute whose norm returns ``(normed, residual)`` (repro/shared_output_discard.py),
under each of ``repro.output_discards``' strategies but ``released`` (that one is the crash):

* ``none``: nothing freed -- what the step costs without the discard's saving;
* ``main-retain``: Megatron-LM main's ``retain_input_tensors=True`` (19deef67): outputs on an
  input's storage kept;
* ``ours``: ``fixes.megatron.apply_output_discard_patch``.

Scenarios:

* ``stack``: four pre-MLP blocks built on megatron-core's ``CheckpointWithoutOutput`` itself
  (``h -> (normed, residual) = norm(h)`` checkpointed, ``y = MLP(normed)``, discard, ``h = y +
  residual``) -- any release with the class (0.16.1 included);
* ``layer``: megatron-core's ``TransformerLayer`` with both norms fused-residual (0.18+: the
  releases whose layer unpacks ``(output, residual)``).

Each cell runs in a child interpreter (``figures_in_child``); figures are
``benchmarks._measure.measure_memory``'s: peak, what forward leaves for backward (the kept
memory), end of backward.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

SCENARIOS = ("stack", "layer")
STRATEGIES = ("none", "main-retain", "ours")
FIGURES_MARKER = "OUTPUT-DISCARD-FIGURES "
# (seq, batch, hidden, blocks of the stack): bytes are exact on CPU, so small; large on the GPU.
SIZES = {"cpu": (128, 2, 128, 4), "cuda": (4096, 1, 4096, 4)}


class _Block(nn.Module):
    def __init__(self, hidden: int):
        from repro.shared_output_discard import ResidualRMSNorm

        super().__init__()
        self.norm = ResidualRMSNorm(None, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, h):
        from megatron.core.tensor_parallel import CheckpointWithoutOutput

        ckpt = CheckpointWithoutOutput()
        normed, residual = ckpt.checkpoint(self.norm, h)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(normed)))
        ckpt.discard_output_and_register_recompute(y)
        return y + residual


def _model(scenario: str, device: str):
    from repro.shared_output_discard import SharedOutputConfig, build_layer

    seq, batch, hidden, blocks = SIZES[device]
    if scenario == "stack":
        torch.manual_seed(0)
        model = nn.Sequential(*(_Block(hidden) for _ in range(blocks))).to(device)
        return model, lambda x: model(x)
    layer = build_layer(device, SharedOutputConfig(seq_len=seq, batch=batch, hidden=hidden,
                                                   heads=max(1, hidden // 64)))
    mask = torch.triu(torch.ones(1, 1, seq, seq, device=device), diagonal=1).bool()
    return layer, lambda x: layer(x, attention_mask=mask)[0]


def print_figures(scenario: str, strategy: str, device: str) -> None:
    """Measure the cell (a warm-up step first) and print its figures after ``FIGURES_MARKER``."""
    from benchmarks._measure import measure_memory
    from fixes.testing.megatron_cpu import bind_missing_te_fp8_state
    from repro.harness.megatron_world import setup_megatron
    from repro.output_discards import output_discard
    from repro.registry import SKIP_MARKER

    if scenario == "layer":
        from megatron.core import __version__
        from megatron.core.transformer.transformer_config import TransformerConfig

        if "fused_residual_rmsnorm" not in TransformerConfig.__dataclass_fields__:
            print(f"{SKIP_MARKER}n/a on megatron-core {__version__}: its TransformerLayer has no "
                  "(output, residual) norm path", file=sys.stderr, flush=True)
            return
    setup_megatron(device)
    bind_missing_te_fp8_state()
    model, run = _model(scenario, device)
    seq, batch, hidden, _ = SIZES[device]
    x = torch.randn(seq, batch, hidden, device=device)

    def forward():
        return run(x.detach().clone().requires_grad_(True)).float().square().mean()

    with output_discard(strategy):
        forward().backward()  # warm-up: lazily built state out of the figures
        model.zero_grad(set_to_none=False)
        figures = measure_memory(forward, device=device, track=[model])
    print(FIGURES_MARKER + json.dumps(figures.as_extra_info()), flush=True)


def figures_in_child(scenario: str, strategy: str, device: str) -> dict:
    """``print_figures`` in a child of its own (``benchmarks._cell_child``: forked by the fork
    server); raises repro.Skipped where the child could not run the cell, RuntimeError with
    its stderr if it failed."""
    from benchmarks._cell_child import run_figures

    if scenario not in SCENARIOS or strategy not in STRATEGIES:
        raise ValueError(f"unknown cell {scenario}/{strategy}: {SCENARIOS} x {STRATEGIES}")
    r, figures = run_figures("_output_discard", FIGURES_MARKER, (scenario, strategy, device))
    if figures is not None:
        return figures
    raise RuntimeError(f"{scenario}/{strategy} on {device}: {r.describe()}\n{r.stderr[-3000:]}")
