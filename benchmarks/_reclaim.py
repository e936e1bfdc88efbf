"""The recompute-reclaim scenario: a small Megatron-like stack of checkpointed layers run through
megatron-core's real ``tensor_parallel.checkpoint`` (CheckpointFunction), under each reclaim
strategy, with and without a chunked MTP-like input.

- ``plain``: ``embed(x) -> L x checkpoint(layer) -> loss``.
- ``chunked-mtp``: the same, then verl's mHC + MTP shape (verl #7328): the decoder output is
  projected to two streams ``h``; ``contract = h * mix`` saves ``h`` for its backward; the MTP
  layer gets ``make_viewless_tensor(torch.chunk(h, 2, -1)[1])`` -- storage shared with ``h`` --
  through its own checkpoint, whose backward runs before ``contract``'s.

Every layer leaks as MoE did (Megatron-LM #3221 / #5227, the reason verl reclaims at all, verl
#5251): its recompute keeps an intermediate on the module (``repro.harness.leaks``), whose graph
holds the detached input and its grad, so both stay allocated after backward unless a reclaim
releases them.

Strategies (``repro.shared_view_reclaim.install_reclaim`` installs each):
``none`` (megatron as shipped), ``unsafe`` (verl 0.8.0's released reclaim: ``resize_(0)`` every
requires-grad input and its grad), ``mtp-skip`` (verl 0.9.1's: the same, but not for checkpoints
whose ``run_function`` closes over a ``MultiTokenPredictionLayer``), ``ours``
(``fixes.megatron.apply_recompute_reclaim_patch``). verl runs one release per process
(``repro.verl_release``), so every (variant, strategy, device) is measured in a child interpreter
of its own (``figures_in_child``). ``unsafe`` on ``chunked-mtp`` frees ``h`` under ``contract``'s
backward (``CRASHES``): its child is run too, and what ended it is the cell's result
(``{"crashed": "SIGSEGV"}``, or the exception's name) -- ``python -m repro --only
shared-view-reclaim-verl080`` shows the same crash.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from repro.harness.leaks import ModuleStateLeak
from repro.harness.optional import OptionalUnavailable, import_optional

VARIANTS = ("plain", "chunked-mtp")
STRATEGIES = ("none", "unsafe", "mtp-skip", "ours")
# strategy -> repro.shared_view_reclaim variant name
_INSTALL = {"none": "none", "unsafe": "verl-0.8.0", "mtp-skip": "verl-0.9.1", "ours": "ours"}
# Cells whose child is expected to crash: no figures, and no relation between strategies holds.
CRASHES = {
    ("chunked-mtp", "unsafe"): "verl's unsafe reclaim frees the chunk's shared storage while "
    "the decoder's contract still reads it (crash 2: SIGSEGV / CUDA illegal memory access); see "
    "`python -m repro --only shared-view-reclaim-verl080`",
}
SIZES = {"seq": 256, "batch": 2, "hidden": 256, "ffn": 1024, "layers": 4}
SEED = 0


def check(variant: str, strategy: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def megatron_unavailable() -> str | None:
    try:
        import_optional("megatron.core.tensor_parallel")
        import_optional("megatron.core.utils")
    except OptionalUnavailable as e:
        return f"megatron-core: {e}"
    return None


class _Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, leaks: ModuleStateLeak):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.leaks = leaks

    def forward(self, x):
        out = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        self.leaks.keep(out)  # in the recompute only (the checkpointed forward runs in no_grad)
        return out


class MultiTokenPredictionLayer(_Layer):
    """An MTP-like layer. The class name is what verl #7328's skip looks for."""


@dataclass
class ReclaimSetup:
    variant: str
    strategy: str
    device: torch.device
    embed: nn.Linear
    layers: nn.ModuleList
    proj: nn.Linear | None
    mix: nn.Parameter | None
    mtp: MultiTokenPredictionLayer | None
    x: torch.Tensor
    leaks: ModuleStateLeak = field(default_factory=ModuleStateLeak)

    @property
    def track(self):
        mods = [self.embed, self.layers] + [m for m in (self.proj, self.mtp) if m is not None]
        return (*mods, *(t for t in (self.mix, self.x) if t is not None))

    def parameters(self):
        for m in self.track:
            if isinstance(m, nn.Module):
                yield from m.parameters()
        if self.mix is not None:
            yield self.mix

    def forward(self) -> torch.Tensor:
        from megatron.core import tensor_parallel
        from megatron.core.utils import make_viewless_tensor

        self.reset()
        h = self.embed(self.x)  # fresh each step, as an embedding's output is
        for layer in self.layers:
            h = tensor_parallel.checkpoint(layer, False, h)
        if self.variant == "plain":
            return h.square().mean()
        streams = self.proj(h)  # [s, b, 2h]: mHC's multistream
        contract = streams * self.mix  # saves `streams` for its backward
        part = make_viewless_tensor(inp=torch.chunk(streams, 2, dim=-1)[1],
                                    requires_grad=True, keep_graph=True)
        mtp_layer = self.mtp

        def custom_forward(hidden_states):
            # A closure over the layer, as Megatron-LM core_v0.19.0+ makes the MTP checkpoint
            # (MultiTokenPredictionLayer._checkpointed_forward): what verl 0.9.1's skip detects.
            return mtp_layer(hidden_states)

        mtp = tensor_parallel.checkpoint(custom_forward, False, part)
        return contract.square().mean() + mtp.square().mean()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.backward(self.forward())

    def reset(self) -> None:
        """Drop the previous step's leaks and grads (so a step's figures are its own)."""
        for p in self.parameters():
            p.grad = None
        self.leaks.clear()
        gc.collect()


def build(variant: str, strategy: str, device: torch.device) -> ReclaimSetup:
    """The model for ``variant`` with ``strategy``'s reclaim installed on megatron-core's
    CheckpointFunction (``uninstall()`` after use)."""
    check(variant, strategy)
    from repro.harness.megatron_world import setup_megatron
    from repro.reclaims import install_reclaim

    setup_megatron(device.type)
    install_reclaim(_INSTALL[strategy])
    s = SIZES
    torch.manual_seed(SEED)
    leaks = ModuleStateLeak()
    layers = nn.ModuleList(_Layer(s["hidden"], s["ffn"], leaks) for _ in range(s["layers"])).to(device)
    proj = mix = mtp = None
    if variant == "chunked-mtp":
        proj = nn.Linear(s["hidden"], 2 * s["hidden"]).to(device)
        mix = nn.Parameter(torch.linspace(0.5, 1.5, 2 * s["hidden"], device=device))
        mtp = MultiTokenPredictionLayer(s["hidden"], s["ffn"], leaks).to(device)
    embed = nn.Linear(s["hidden"], s["hidden"]).to(device)
    x = torch.randn(s["seq"], s["batch"], s["hidden"], device=device)
    return ReclaimSetup(variant, strategy, device, embed, layers, proj, mix, mtp, x, leaks)


def uninstall() -> None:
    from repro.reclaims import install_reclaim

    install_reclaim("none")


FIGURES_MARKER = "RECLAIM-FIGURES "


def print_figures(variant: str, strategy: str, device: str) -> None:
    """In a child: warm-up step, then one measured step; the figures on a marker line."""
    from benchmarks._measure import measure_memory
    from repro import Skipped
    from repro.registry import SKIP_MARKER

    try:
        setup = build(variant, strategy, torch.device(device))
    except Skipped as skip:  # e.g. the verl release is not installed
        print(SKIP_MARKER + " ".join(str(skip).split()), file=sys.stderr, flush=True)
        return
    try:
        setup.step()  # warm-up
        setup.reset()
        figures = measure_memory(setup.forward, backward=setup.backward, device=device,
                                 track=setup.track).as_extra_info()
        figures["reclaim_own_bytes"] = _own_bytes(torch.device(device))
        setup.reset()
    finally:
        uninstall()
    print(FIGURES_MARKER + json.dumps(figures), flush=True)


def _own_bytes(device: torch.device) -> int:
    """Device bytes ours keeps for itself: the shared elements its released copies point at
    (``fixes.megatron.reclaim``: one per dtype and device, made when it is installed), as the
    CUDA caching allocator's blocks holding them -- a constant, in every figure on CUDA (which
    counts all live memory), in none on CPU (which counts what the step allocates)."""
    from fixes.megatron import reclaim

    if device.type != "cuda":
        return 0
    ptrs = {t.data_ptr() for (_, d), t in reclaim._SCALARS.items() if d.type == "cuda"}
    return sum(block["size"] for segment in torch.cuda.memory_snapshot()
               for block, address in _blocks(segment) if address in ptrs
               and block["state"] == "active_allocated")


def _blocks(segment: dict):
    address = segment["address"]
    for block in segment["blocks"]:
        yield block, address
        address += block["size"]


def _crash_name(stderr: str) -> str | None:
    """The exception type on a traceback's last line (``torch.AcceleratorError: CUDA error...``)."""
    for line in reversed(stderr.strip().splitlines()):
        # torch.distributed prefixes a rank's traceback lines: "[rank0]: RuntimeError: ..."
        m = re.match(r"(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception)):", line)
        if m:
            return m.group(1).rsplit(".", 1)[-1]
    return None


def figures_in_child(variant: str, strategy: str, device: str) -> dict:
    """``print_figures`` in a child of its own (``benchmarks._cell_child``: forked by the fork
    server; verl's release imported by the child itself). A cell of ``CRASHES`` whose child
    died by a signal or an exception gives ``{"crashed": name}``. Raises repro.Skipped where
    the child could not run (a verl release not installed), RuntimeError with its stderr if it
    failed otherwise (also a crash outside ``CRASHES``)."""
    from benchmarks._cell_child import run_figures

    check(variant, strategy)
    r, figures = run_figures("_reclaim", FIGURES_MARKER, (variant, strategy, device))
    if figures is not None:
        return figures
    crashed = r.signal_name or (None if r.timed_out else _crash_name(r.stderr))
    if (variant, strategy) in CRASHES and crashed:
        return {"crashed": crashed}
    raise RuntimeError(f"{variant}/{strategy} on {device}: {r.describe()}\n{r.stderr[-3000:]}")
