"""Crash 3 — MTP shape mismatch with hyper-connections (mHC): the postprocess drops the streams.

A minimal, faithful model of the data contract on Megatron-LM's ``dev`` branch (the only place
mHC exists; see fixes/megatron/mtp_postprocess.py for the files it follows), in plain torch:

1. The decoder widens the embedding ``[s, b, h]`` into ``n`` residual streams ``[s, b, n*h]``
   (``HyperConnectionModule.input_expand``), runs hyper-connected layers on them and contracts
   them at the end with a learned gated sum (``learned_output_contract``). With MTP on it returns
   both: ``(contracted [s, b, h], mhc_multistream [s, b, n*h])``.
2. The model's ``_postprocess`` must hand ``mhc_multistream`` to the MTP block, which feeds its
   depths from the streams; each MTP layer views its input as ``(s, b, n, h)``, mixes in the
   next token's embedding per stream, and its output is contracted for the MTP loss.
3. verl's replacement postprocess, as verl #7328 reports it, took ``mhc_multistream`` and never
   passed it on, so the MTP block fed its depth from the contracted states and the view failed:
   ``RuntimeError: shape '[23986, 1, 4, 4096]' is invalid for input of size 98246656``.
   (No verl release has that copy; repro/mtp_shape_megatron_dev.py runs the real dev model
   behind verl 0.8.0's released one.)

Unfixed: ``MHCGPT._postprocess`` drops the streams (as verl's did) -> that RuntimeError, here
``shape '[16, 2, 2, 64]' is invalid for input of size 2048``. Fixed: the class is patched with
``fixes.megatron.mtp_postprocess.apply_mtp_postprocess_patch`` — the very wrapper shipped for
megatron-core's GPTModel — and forward + backward complete. The oracle (WrongResult otherwise)
checks a finite loss that includes the MTP loss, that the MTP depth read the decoder's streams
(same storage, width n*h), and that the MTP loss sends gradient into the MTP layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.registry import Repro, Signature, WrongResult


@dataclass(kw_only=True, slots=True, frozen=True)
class MTPShapeConfig:
    seq_len: int = 16
    batch: int = 2
    hidden: int = 64
    streams: int = 2  # n, Megatron's num_residual_streams
    vocab: int = 128
    decoder_layers: int = 2
    mtp_depths: int = 1  # Megatron's mtp_num_layers
    mtp_loss_scale: float = 0.1
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch", "hidden", "vocab", "decoder_layers", "mtp_depths"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.streams < 2:
            raise ValueError(f"streams must be >= 2 (mHC needs several residual streams), got {self.streams}")

    @property
    def crash_message(self) -> str:
        """The view error of an MTP layer handed contracted [s, b, h] states."""
        s, b, n, h = self.seq_len, self.batch, self.streams, self.hidden
        return f"shape '[{s}, {b}, {n}, {h}]' is invalid for input of size {s * b * h}"


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[s, b, h] -> [s, b, n*h]: every stream starts as a copy of the input."""
    s, b, h = x.shape
    return x.unsqueeze(2).expand(s, b, n, h).reshape(s, b, n * h)


class StreamContract(nn.Module):
    """[s, b, n*h] -> [s, b, h]: a sigmoid-gated, input-dependent weighted sum of the streams."""

    def __init__(self, n: int, h: int):
        super().__init__()
        self.n = n
        self.gate = nn.Linear(n * h, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        weights = torch.sigmoid(self.gate(F.rms_norm(x, x.shape[-1:])))  # [s, b, n]
        return (weights.unsqueeze(-1) * x.view(s, b, self.n, -1)).sum(dim=-2)


class HyperConnectedLayer(nn.Module):
    """One layer on n streams: read a learned mix of the streams, run an MLP on it, write the
    result back to each stream with its own weight, and mix the residual streams."""

    def __init__(self, n: int, h: int):
        super().__init__()
        self.n = n
        self.read = nn.Parameter(torch.full((n,), 1.0 / n))
        self.write = nn.Parameter(torch.ones(n))
        self.mix = nn.Parameter(torch.eye(n))
        self.norm = nn.RMSNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        streams = x.view(s, b, self.n, -1)  # mHC layers see their input as (s, b, n, h)
        out = self.mlp(self.norm(torch.einsum("sbnh,n->sbh", streams, self.read)))
        streams = torch.einsum("sbnh,nm->sbmh", streams, self.mix)
        streams = streams + self.write.view(1, 1, -1, 1) * out.unsqueeze(2)
        return streams.reshape(s, b, -1)


class MHCDecoder(nn.Module):
    """Expands to n streams, runs the layers, contracts; with MTP returns both ends."""

    def __init__(self, cfg: MTPShapeConfig):
        super().__init__()
        n, h = cfg.streams, cfg.hidden
        self.n = n
        self.layers = nn.ModuleList(HyperConnectedLayer(n, h) for _ in range(cfg.decoder_layers))
        self.contract = StreamContract(n, h)
        self.final_norm = nn.RMSNorm(h)
        self.return_multistream = cfg.mtp_depths > 0

    def forward(self, embedded: torch.Tensor):
        x = expand_streams(embedded, self.n)
        for layer in self.layers:
            x = layer(x)
        contracted = self.final_norm(self.contract(x))
        if self.return_multistream:
            return contracted, x  # (contracted [s,b,h], mhc_multistream [s,b,n*h])
        return contracted


class MTPLayer(nn.Module):
    """One MTP depth in mHC mode: the i-th streams plus the (i+1)-th token's embedding."""

    def __init__(self, cfg: MTPShapeConfig):
        super().__init__()
        n, h = cfg.streams, cfg.hidden
        self.n, self.h = n, h
        self.enorm, self.hnorm = nn.RMSNorm(h), nn.RMSNorm(h)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)  # per stream
        self.layer = HyperConnectedLayer(n, h)
        self.contract = StreamContract(n, h)
        self.final_norm = nn.RMSNorm(h)

    def forward(self, input_ids, hidden_states, embedding):
        input_ids = torch.roll(input_ids, shifts=-1, dims=0)  # next token ([s, b] layout)
        e = self.enorm(embedding(input_ids))
        s, b, _ = hidden_states.shape
        # The crash site: contracted [s, b, h] states cannot be viewed as n streams of h.
        streams = self.hnorm(hidden_states.view(s, b, self.n, self.h))
        x = (self.e_proj(e).unsqueeze(2) + self.h_proj(streams)).reshape(s, b, self.n * self.h)
        return self.layer(x), input_ids

    def postprocess(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(self.contract(x))


class MTPBlock(nn.Module):
    """Feeds its depths from ``mhc_multistream`` when given, else from the contracted states;
    returns the contracted states of the main model and of every depth, concatenated on dim 0."""

    def __init__(self, cfg: MTPShapeConfig):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.mtp_depths))

    def forward(self, input_ids, hidden_states, embedding, mhc_multistream=None):
        outputs = [hidden_states]
        x = mhc_multistream if mhc_multistream is not None else hidden_states
        for layer in self.layers:
            x, input_ids = layer(input_ids, x, embedding)
            outputs.append(layer.postprocess(x))
        return torch.cat(outputs, dim=0)


class MHCGPT(nn.Module):
    """Embedding -> mHC decoder -> postprocess (MTP block, LM head, losses)."""

    def __init__(self, cfg: MTPShapeConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab, cfg.hidden)
        self.decoder = MHCDecoder(cfg)
        self.mtp = MTPBlock(cfg)
        self.output_layer = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids, labels):
        """input_ids, labels: [s, b]. Returns (lm_loss, mtp_losses [depths])."""
        decoder_output = self.decoder(self.embedding(input_ids))
        if isinstance(decoder_output, tuple):
            hidden_states, mhc_multistream = decoder_output
        else:
            hidden_states, mhc_multistream = decoder_output, None
        return self._postprocess(hidden_states, input_ids, labels, mhc_multistream=mhc_multistream)

    def _postprocess(self, hidden_states, input_ids, labels, mhc_multistream=None):
        # The unfixed postprocess: like the copy verl #7328 reports, it takes mhc_multistream
        # and never passes it to self.mtp.
        hidden_states = self.mtp(
            input_ids=input_ids, hidden_states=hidden_states, embedding=self.embedding
        )
        chunks = torch.chunk(hidden_states, 1 + self.cfg.mtp_depths, dim=0)
        lm_loss = self._loss(chunks[0], labels)
        mtp_losses = []
        for chunk in chunks[1:]:
            labels = torch.roll(labels, shifts=-1, dims=0)
            mtp_losses.append(self._loss(chunk, labels))
        return lm_loss, torch.stack(mtp_losses)

    def _loss(self, hidden_states, labels):
        logits = self.output_layer(hidden_states)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def run(fixed: bool, device: str, cfg: MTPShapeConfig | None = None) -> None:
    cfg = cfg or MTPShapeConfig()
    if fixed:
        from fixes.megatron.mtp_postprocess import apply_mtp_postprocess_patch

        apply_mtp_postprocess_patch(MHCGPT)
    torch.manual_seed(cfg.seed)
    model = MHCGPT(cfg).to(device)
    input_ids = torch.randint(0, cfg.vocab, (cfg.seq_len, cfg.batch), device=device)
    labels = torch.roll(input_ids, shifts=-1, dims=0)

    # Watch the mechanism from outside the model: the decoder's streams and the MTP depth input.
    seen = {}

    def _see_streams(module, args, output):
        seen["decoder"] = output

    def _see_depth_input(module, args):
        seen["depth_input"] = args[1]  # MTPLayer.forward(input_ids, hidden_states, embedding)

    model.decoder.register_forward_hook(_see_streams)
    model.mtp.layers[0].register_forward_pre_hook(_see_depth_input)

    lm_loss, mtp_losses = model(input_ids, labels)
    loss = lm_loss + cfg.mtp_loss_scale * mtp_losses.mean()
    loss.backward()

    if not torch.isfinite(loss):
        raise WrongResult(f"loss is not finite: {loss.item()}")
    if mtp_losses.numel() != cfg.mtp_depths or not torch.isfinite(mtp_losses).all():
        raise WrongResult(f"MTP losses missing or not finite: {mtp_losses.tolist()}")
    streams = seen["decoder"][1]
    depth_input = seen["depth_input"]  # before the direct call below runs the hook again
    # An independent oracle: the MTP losses the model reported must be the ones its MTP block
    # computes from the decoder's own streams, called directly with them here.
    contracted = seen["decoder"][0]
    with torch.no_grad():
        direct = model.mtp(input_ids=input_ids, hidden_states=contracted,
                           embedding=model.embedding, mhc_multistream=streams)
        depth_out = torch.chunk(direct, 1 + cfg.mtp_depths, dim=0)[1:]
        shifted, expected = labels, []
        for out in depth_out:
            shifted = torch.roll(shifted, shifts=-1, dims=0)
            expected.append(model._loss(out, shifted))
    if not torch.allclose(mtp_losses.detach(), torch.stack(expected), rtol=1e-6, atol=1e-6):
        raise WrongResult(f"MTP losses {mtp_losses.tolist()} are not those of the MTP block on the "
                          f"decoder's streams {torch.stack(expected).tolist()}")
    if depth_input.shape[-1] != cfg.streams * cfg.hidden or (
        depth_input.untyped_storage().data_ptr() != streams.untyped_storage().data_ptr()
    ):
        raise WrongResult(
            f"MTP depth 0 read {tuple(depth_input.shape)}, not the decoder's streams {tuple(streams.shape)}"
        )
    grad = model.mtp.layers[0].h_proj.weight.grad
    if grad is None or not torch.isfinite(grad).all() or grad.abs().sum() == 0:
        raise WrongResult("the MTP loss sent no gradient into the MTP layer")
    print(
        f"mtp-shape: loss {loss.item():.4f} (lm {lm_loss.item():.4f}, "
        f"mtp {mtp_losses.tolist()}), depth input {tuple(depth_input.shape)}"
    )


REPROS = [
    Repro(
        name="mtp-shape",
        summary="mHC decoder + MTP: postprocess drops mhc_multistream, MTP views [s,b,h] as (s,b,n,h)",
        run=run,
        signatures=(
            Signature(exception="RuntimeError", message=MTPShapeConfig().crash_message),
        ),
        devices=("cpu", "cuda"),
        timeout=120.0,
        upstream="verl #7328; Megatron-LM dev: GPTModel._postprocess(mhc_multistream=...)",
    ),
]
