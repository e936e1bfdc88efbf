"""The activation-checkpointing scenario: none / selective / full AC, each with and without the
mesh-preserving ``context_fn`` (fixes.torchtitan), on two models:

- ``llama3-debugmodel``: torchtitan 0.3.0's llama3 ``debugmodel`` flavor (6.2M parameters),
  checkpointed by torchtitan's own ``FullAC`` / ``SelectiveAC`` (``apply``), made mesh-safe
  by ``make_checkpoint_wrappers_mesh_preserving``. Attention is SDPA: flex attention has no
  CPU backward (torch 2.13), and torchtitan's registry refuses ``sdpa`` for language models,
  so the flavor is built with flex and its inner attention config swapped for SDPA's.
- ``plain-transformer``: a small pre-norm transformer in plain torch, checkpointed per block
  with ``torch.utils.checkpoint`` (``mesh_preserving_context_fn``): it runs where torchtitan's
  models do not import (torch 2.11 on the GPU machine).

The step runs forward and backward inside ``spmd_types.set_current_mesh`` (a real world-size-1
mesh, repro.harness.spmd_mesh), as a fixed engine's train context does, so the mesh-preserving variant
does its whole job (snapshot at forward, re-entry at recompute) and its cost is measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.harness.optional import OptionalUnavailable, import_optional

AC_MODES = ("none", "selective", "full")
MODELS = ("plain-transformer", "llama3-debugmodel")
SEED = 0


@dataclass(frozen=True, slots=True)
class ACCase:
    ac: str
    mesh_ctx: bool = False

    def __post_init__(self):
        if self.ac not in AC_MODES:
            raise ValueError(f"ac must be one of {AC_MODES}, got {self.ac!r}")
        if self.ac == "none" and self.mesh_ctx:
            raise ValueError("ac='none' has no checkpoint, so no context_fn to make mesh-preserving")

    @property
    def strategy(self) -> str:
        return f"{self.ac}+mesh_ctx" if self.mesh_ctx else self.ac


CASES = (
    ACCase("none"),
    ACCase("selective"), ACCase("selective", mesh_ctx=True),
    ACCase("full"), ACCase("full", mesh_ctx=True),
)


@dataclass
class ACSetup:
    """A built model and its input; ``forward()`` returns the loss, ``step()`` is forward and
    backward inside the mesh context, as a training step runs them."""

    model: nn.Module
    tokens: torch.Tensor
    mesh: object

    def _mesh_context(self):
        import spmd_types

        return spmd_types.set_current_mesh(self.mesh)

    def forward(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)  # no gradients of an earlier step in the figures
        with self._mesh_context():
            return self.model(self.tokens).float().pow(2).mean()

    def backward(self, loss: torch.Tensor) -> None:
        with self._mesh_context():
            loss.backward()

    def step(self) -> None:
        self.backward(self.forward())

    @property
    def track(self):
        return (self.model, self.tokens)


def _mesh():
    from repro.harness.spmd_mesh import spmd_mesh

    return spmd_mesh("tp")


# --- plain-transformer -------------------------------------------------------------------

# Per device type: small enough for two CPU cores, large enough on an H200 that recompute and
# the step time are more than launch overhead.
PLAIN = {
    "cpu": {"dim": 128, "heads": 4, "hidden": 512, "layers": 4, "vocab": 512, "batch": 2, "seq": 256},
    "cuda": {"dim": 1024, "heads": 16, "hidden": 4096, "layers": 8, "vocab": 8192, "batch": 4,
             "seq": 2048},
}
_MM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default}
_SDPA_OPS = {
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)
}


def make_selective_policy():
    """A fresh torchtitan-style selective policy: keep attention outputs and every other matmul
    output, recompute the rest (counted separately in forward and recompute, so both make the
    same choices). Stateful, hence one per checkpoint call."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _SDPA_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in _MM_OPS:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class _Checkpointed(nn.Module):
    """One block under non-reentrant ``torch.utils.checkpoint`` with a per-call context_fn."""

    def __init__(self, block: nn.Module, context_fn: Callable):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


def _plain_context_fn(case: ACCase) -> Callable:
    """The per-call ``context_fn`` of ``case``: selective (a fresh policy each call) or full,
    wrapped by ``mesh_preserving_context_fn`` when ``case.mesh_ctx``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from fixes.torchtitan import mesh_preserving_context_fn

    if case.ac == "selective":
        if case.mesh_ctx:
            return lambda: mesh_preserving_context_fn(make_selective_policy())
        return lambda: create_selective_checkpoint_contexts(make_selective_policy())
    if case.mesh_ctx:
        return mesh_preserving_context_fn
    return lambda: (contextlib.nullcontext(), contextlib.nullcontext())


class PlainTransformer(nn.Module):
    def __init__(self, case: ACCase, *, dim, heads, hidden, layers, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        blocks = [_Block(dim, heads, hidden) for _ in range(layers)]
        if case.ac != "none":
            blocks = [_Checkpointed(b, _plain_context_fn(case)) for b in blocks]
        self.layers = nn.ModuleList(blocks)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_plain(case: ACCase, device: torch.device) -> ACSetup:
    cfg = PLAIN[device.type]
    torch.manual_seed(SEED)
    model = PlainTransformer(case, dim=cfg["dim"], heads=cfg["heads"], hidden=cfg["hidden"],
                             layers=cfg["layers"], vocab=cfg["vocab"]).to(device)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=device)
    return ACSetup(model, tokens, _mesh())


# --- llama3-debugmodel (torchtitan) ------------------------------------------------------

LLAMA = {"flavor": "debugmodel", "batch": 1, "seq": 128}


def torchtitan_unavailable() -> str | None:
    """Why torchtitan's llama3 cannot be built here, or None: not installed, or (torch 2.11, the
    GPU machine) torchtitan 0.3.0's models fail to import (DataParallelMeshDims missing). Any
    other import failure is a broken install and raises."""
    try:
        import_optional("torchtitan.distributed.activation_checkpoint")
        import_optional("torchtitan.models.llama3")
    except OptionalUnavailable as e:
        return f"torchtitan llama3 on torch {torch.__version__}: {e}"
    return None


def build_llama3(case: ACCase, device: torch.device) -> ACSetup:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from fixes.torchtitan import make_checkpoint_wrappers_mesh_preserving

    config = model_registry(LLAMA["flavor"], attn_backend="flex").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(SEED)
    with torch.device(device):
        model = config.build()
    if hasattr(model, "init_weights"):
        with torch.no_grad():
            model.init_weights()
    if case.ac == "full":
        FullAC(FullAC.Config()).apply(model)
    elif case.ac == "selective":
        SelectiveAC(SelectiveAC.Config()).apply(model)
    if case.mesh_ctx:
        wrapped = make_checkpoint_wrappers_mesh_preserving(model)
        if wrapped != len(model.layers):
            raise RuntimeError(f"{wrapped} checkpoint wrappers made mesh-preserving, expected {len(model.layers)}")
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab, (LLAMA["batch"], LLAMA["seq"]), generator=g).to(device)
    return ACSetup(model, tokens, _mesh())


BUILDERS = {"plain-transformer": build_plain, "llama3-debugmodel": build_llama3}


def build(model: str, case: ACCase, device: torch.device) -> ACSetup:
    if model not in BUILDERS:
        raise ValueError(f"model must be one of {tuple(BUILDERS)}, got {model!r}")
    return BUILDERS[model](case, device)
