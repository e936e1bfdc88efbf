"""Crash 3 on the real thing: Megatron-LM dev's GPT with hyper-connections + MTP, verl's postprocess.

repro/mtp_shape.py models the data contract in plain torch; this runs Megatron-LM ``dev``
itself (the checkout ``STACKFIX_MEGATRON_LM`` names, pinned d48bd6be; repro/harness/
megatron_lm.py): a GPTModel with ``enable_hyper_connections``, 2 residual streams and one MTP
depth (local spec, 2 layers, hidden 64, seq 16, batch 2, world size 1), with verl's own
released postprocess installed the way verl installs it, ``patch_postprocess(model)`` from
verl/models/mcore/mtp_patch.py (loaded with repro.verl_release).

What verl does on dev (d48bd6be), by release:

* verl 0.8.0: its copy of ``_postprocess`` predates the keywords dev's ``GPTModel.forward``
  passes, so the first forward raises ``TypeError: _megatron_gptmodel_postprocess() got an
  unexpected keyword argument 'padding_mask'`` — repro ``mtp-shape-megatron-dev-verl080``.
* The copy verl #7328 describes takes those keywords and never hands ``mhc_multistream`` to
  ``self.mtp``; dev's MTP layer then views the contracted ``[s, b, h]`` states as ``(s, b, n,
  h)``: ``RuntimeError: shape '[16, 2, 2, 64]' is invalid for input of size 2048`` — repro
  ``mtp-shape-megatron-dev``: verl 0.8.0's body behind an adapter that passes it only the
  keywords it declares (no released verl has that copy: the parameter arrived with #7328's fix).
* verl 0.9.0 / 0.9.1 forward the streams and run (tests/test_mtp_megatron_dev.py).

Fixed: the same verl 0.8.0 postprocess (and adapter) installed on the model *after*
``fixes.megatron.apply_mtp_postprocess_patch()``, as when a user patches at start-up and verl
patches each model it builds. The oracle's reference is dev's own ``GPTModel._postprocess`` on
the same weights and batch, run first with no patch at all. WrongResult unless: the MTP depth
read the decoder's streams (width n*h, same storage); the MTP loss megatron attaches to the
output (``MTPLossAutoScaler``'s saved loss) is finite and equals the reference's; and every MTP
parameter gradient is finite, ``h_proj``'s nonzero, and equal to the reference's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from repro.harness import megatron_lm
from repro.registry import Repro, Signature, Skipped, WrongResult

VERL_RELEASE = "0.8.0"  # the last release whose postprocess does not forward the streams


@dataclass(kw_only=True, slots=True, frozen=True)
class DevMTPConfig:
    seq_len: int = 16
    batch: int = 2
    hidden: int = 64
    heads: int = 4
    streams: int = 2  # num_residual_streams (n)
    vocab: int = 128
    decoder_layers: int = 2
    mtp_depths: int = 1
    seed: int = 0

    @property
    def crash_message(self) -> str:
        """dev's MTP layer viewing contracted [s, b, h] states as n streams."""
        s, b, n, h = self.seq_len, self.batch, self.streams, self.hidden
        return f"shape '[{s}, {b}, {n}, {h}]' is invalid for input of size {s * b * h}"


def setup_dev_megatron(device: str) -> None:
    """The checkout first on sys.path, world size 1, CPU shims on CPU, and the local-spec
    workaround (repro/harness/megatron_lm.py says why) on every device."""
    from repro.harness.megatron_lm import (
        install_local_spec_nd_wgrad_workaround,
        use_megatron_lm_checkout,
    )

    use_megatron_lm_checkout()  # Skipped when STACKFIX_MEGATRON_LM is unset
    from repro.harness.megatron_world import setup_megatron

    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import install_megatron_cpu_shims

        install_megatron_cpu_shims(force=True)
    install_local_spec_nd_wgrad_workaround()


def build_dev_gpt(cfg: DevMTPConfig, device: str):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=cfg.decoder_layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        mtp_num_layers=cfg.mtp_depths, enable_hyper_connections=True,
        num_residual_streams=cfg.streams, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(enable_hyper_connection=True)
    torch.manual_seed(cfg.seed)
    model = GPTModel(
        config, spec, vocab_size=cfg.vocab, max_sequence_length=cfg.seq_len,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    ).to(device)
    # Training mode logs the MTP loss into a tracker allocated on torch.cuda.current_device();
    # on CPU run eval mode (dropout is 0; the MTP loss is attached to the output either way).
    model.train(device == "cuda")
    return model


def make_batch(cfg: DevMTPConfig, device: str):
    g = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=g).to(device)
    pos = torch.arange(cfg.seq_len, device=device).expand(cfg.batch, cfg.seq_len)
    causal = torch.ones(1, 1, cfg.seq_len, cfg.seq_len, dtype=torch.bool, device=device)
    return ids, pos, causal.tril().logical_not(), torch.roll(ids, -1, 1)


def attached_mtp_losses(output: torch.Tensor) -> list[torch.Tensor]:
    """The per-token MTP losses megatron hung on ``output``'s graph (``MTPLossAutoScaler``
    saves each depth's scaled loss for its backward), found by walking the graph."""
    found, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "MTPLossAutoScalerBackward":
            found.append(node.saved_tensors[0].detach().clone())
        todo.extend(n for n, _ in node.next_functions)
    return sorted(found, key=lambda t: t.sum().item())


@dataclass
class Step:
    """What one forward + backward showed."""

    mtp_losses: list[torch.Tensor]
    mtp_grads: dict[str, torch.Tensor]
    depth_input: torch.Tensor
    streams: torch.Tensor


def train_step(model, batch) -> Step:
    """Forward + backward, watching the decoder's output and the MTP depth's input from outside.
    dev's own postprocess returns the LM loss [b, s]; verl's returns logits [b, s, V] (verl
    computes its loss itself), here a mean cross entropy."""
    ids, pos, mask, labels = batch
    seen = {}
    hooks = [
        model.decoder.register_forward_hook(lambda m, a, out: seen.update(decoder=out)),
        model.mtp.layers[0].register_forward_pre_hook(
            lambda m, a, kw: seen.update(depth_input=kw["hidden_states"]), with_kwargs=True),
    ]
    model.zero_grad(set_to_none=True)
    try:
        out = model(ids, pos, mask, labels=labels)
    finally:
        for h in hooks:
            h.remove()
    losses = attached_mtp_losses(out)
    loss = out.mean() if out.dim() == 2 else F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if n.startswith("mtp.") and p.grad is not None}
    decoder_out = seen["decoder"]
    streams = decoder_out[1] if isinstance(decoder_out, tuple) else decoder_out
    return Step(losses, grads, seen["depth_input"], streams)


def passing_declared_keywords_only(postprocess: Callable) -> Callable:
    """``postprocess`` called with only the keywords it declares: the copy verl #7328 describes,
    which took dev's keywords and never passed ``mhc_multistream`` on."""
    declared = inspect.signature(postprocess).parameters

    def postprocess_dropping_the_rest(*args, **kwargs):
        return postprocess(*args, **{k: v for k, v in kwargs.items() if k in declared})

    return postprocess_dropping_the_rest


def install_verl_postprocess(model, version: str = VERL_RELEASE, streams_dropped: bool = False):
    """verl's ``patch_postprocess(model)`` from release ``version``, as verl calls it."""
    from repro.verl_release import VerlUnavailable, import_verl

    try:
        mtp_patch = import_verl(version, "verl.models.mcore.mtp_patch")
    except VerlUnavailable as exc:
        raise Skipped(str(exc)) from exc
    mtp_patch.patch_postprocess(model)
    if streams_dropped:
        # the instance attribute verl assigned, not what a class-level descriptor returns for it
        model._postprocess = passing_declared_keywords_only(model.__dict__["_postprocess"])
    return mtp_patch


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    """Equal up to ``rtol`` of ``b``'s norm (CPU runs were bitwise equal; a shape-only fix that
    hands MTP copies of the contracted states is off by 2e-5 in the loss, 2e-3 in h_proj's grad)."""
    return bool(torch.isfinite(a).all()) and (a - b).norm().item() <= rtol * b.norm().item() + 1e-12


def check_reads_the_streams(got: Step, cfg: DevMTPConfig) -> None:
    """The mechanism: MTP depth 0 was fed the decoder's own multi-stream output."""
    if got.depth_input.shape[-1] != cfg.streams * cfg.hidden or (
        got.depth_input.untyped_storage().data_ptr() != got.streams.untyped_storage().data_ptr()
    ):
        raise WrongResult(f"MTP depth 0 read {tuple(got.depth_input.shape)}, not the decoder's "
                          f"streams {tuple(got.streams.shape)}")


def check_matches_reference(got: Step, ref: Step, cfg: DevMTPConfig) -> None:
    """The result: MTP loss and MTP gradients as dev's own postprocess computes them."""
    if len(got.mtp_losses) != cfg.mtp_depths:
        raise WrongResult(f"{len(got.mtp_losses)} MTP losses attached, expected {cfg.mtp_depths}")
    for a, b in zip(got.mtp_losses, ref.mtp_losses, strict=True):
        if not _close(a, b, rtol=1e-6):
            raise WrongResult(f"MTP loss {a.sum().item()} differs from dev's own postprocess "
                              f"{b.sum().item()}")
    if got.mtp_grads.keys() != ref.mtp_grads.keys():
        raise WrongResult(f"MTP parameters with gradients differ: "
                          f"{sorted(got.mtp_grads.keys() ^ ref.mtp_grads.keys())}")
    h_proj = got.mtp_grads.get("mtp.layers.0.h_proj.weight")
    if h_proj is None or h_proj.abs().sum() == 0:
        raise WrongResult("the MTP loss sent no gradient into the MTP layer's h_proj")
    for name, g in got.mtp_grads.items():
        if not _close(g, ref.mtp_grads[name], rtol=1e-5):
            raise WrongResult(f"gradient of {name} differs from dev's own postprocess")


def run_scenario(fixed: bool, device: str, *, streams_dropped: bool, version: str = VERL_RELEASE,
                 cfg: DevMTPConfig | None = None) -> None:
    cfg = cfg or DevMTPConfig()
    setup_dev_megatron(device)
    model = build_dev_gpt(cfg, device)
    batch = make_batch(cfg, device)
    reference = train_step(model, batch)  # dev's own GPTModel._postprocess, nothing patched
    if fixed:
        from fixes.megatron import apply_mtp_postprocess_patch

        apply_mtp_postprocess_patch()
    install_verl_postprocess(model, version, streams_dropped=streams_dropped)
    got = train_step(model, batch)
    check_reads_the_streams(got, cfg)
    check_matches_reference(got, reference, cfg)
    scale = model.config.mtp_loss_scaling_factor / cfg.mtp_depths
    print(f"mtp-shape-megatron-dev: verl {version} postprocess{' + ours' if fixed else ''}: "
          f"MTP loss {[round(t.sum().item() / scale, 4) for t in got.mtp_losses]} == dev's own, "
          f"depth input {tuple(got.depth_input.shape)}, {len(got.mtp_grads)} MTP grads == dev's own")


def run_streams_dropped(fixed: bool, device: str) -> None:
    run_scenario(fixed, device, streams_dropped=True)


def run_verl_release(fixed: bool, device: str) -> None:
    run_scenario(fixed, device, streams_dropped=False)


_UPSTREAM = "verl #7328; Megatron-LM #4518 (dev: mHC + MTP, mhc_multistream)"
REPROS = [
    Repro(
        name="mtp-shape-megatron-dev",
        summary="Megatron-LM dev mHC + MTP: verl's postprocess never passes mhc_multistream, "
        "dev's MTP layer views [s,b,h] as (s,b,n,h)",
        run=run_streams_dropped,
        signatures=(Signature(exception="RuntimeError", message=DevMTPConfig().crash_message),),
        devices=("cpu", "cuda"),
        timeout=300.0,
        upstream=_UPSTREAM,
        forkserver=None,  # megatron from the checkout, not the installed megatron-core
        precondition=megatron_lm.skip_reason,  # STACKFIX_MEGATRON_LM unset: no child started
    ),
    Repro(
        name="mtp-shape-megatron-dev-verl080",
        summary="Megatron-LM dev mHC + MTP with verl 0.8.0's patch_postprocess as released: "
        "its copy rejects dev's keywords",
        run=run_verl_release,
        signatures=(Signature(exception="TypeError",
                              message="unexpected keyword argument 'padding_mask'"),),
        devices=("cpu", "cuda"),
        timeout=300.0,
        upstream=_UPSTREAM,
        forkserver=None,  # megatron from the checkout, not the installed megatron-core
        precondition=megatron_lm.skip_reason,  # STACKFIX_MEGATRON_LM unset: no child started
    ),
]
