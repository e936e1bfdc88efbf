"""The MTP completeness of a whole bucketed refit, checked once at its end.

vLLM 0.27-0.33 had each MTP model's ``load_weights`` raise "MTP ... weights missing from
checkpoint" unless every MTP layer got a weight *in that call*; a bucketed refit turned it off
per bucket (``mtp_completeness_check_disabled``, verl #7328). vLLM 0.34.0 removed the check
(``model_loader/mtp_validation.py`` is gone): a refit that never sends the MTP weights now leaves
the drafter on its previous weights, silently. ``mtp_refit_completeness(model)`` puts the check
back where it belongs for a refit -- over all its buckets -- on any vLLM::

    with mtp_refit_completeness(drafter):          # MtpWeightsMissingError at the end if an
        for bucket in buckets:                     # MTP layer got no weight in any bucket
            load_refit_weights(drafter, bucket)    # or drafter.load_weights(bucket)

In verl's refit (``vLLMColocateWorkerExtension.update_weights_from_ipc``: one
``model.load_weights(bucket)`` per model per received bucket, main model and MTP drafter alike)
the context goes around the receive loop, on the drafter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

__all__ = ["MtpRefit", "MtpWeightsMissingError", "mtp_refit_completeness"]


class MtpWeightsMissingError(ValueError):
    """A refit ended without any weight of one or more MTP layers (``missing``: their keys)."""

    def __init__(self, message: str, missing: tuple):
        super().__init__(message)
        self.missing = missing


def _mtp_layers(model: nn.Module) -> dict[object, str]:
    """vLLM's MTP models' layout (DeepSeekMTP and the models built like it): layers
    ``model.layers.<i>`` for i in ``[mtp_start_layer_idx, + num_mtp_layers)``."""
    inner = getattr(model, "model", None)
    start = getattr(inner, "mtp_start_layer_idx", None)
    count = getattr(inner, "num_mtp_layers", None)
    if start is None or count is None:
        raise TypeError(
            f"{type(model).__name__} does not say which layers are its MTP layers (no "
            "model.mtp_start_layer_idx / model.num_mtp_layers, as vLLM's DeepSeekMTP has): give "
            "them as layers={key: 'name.prefix.'}")
    return {i: f"model.layers.{i}." for i in range(start, start + count)}


class MtpRefit:
    """What one refit loaded (``loaded``: the parameter names, over ``buckets`` loads) into a
    model whose MTP layers are ``layers`` (key -> name prefix). A context manager: inside it the
    model's ``load_weights`` is counted; on a clean exit a layer none of whose names was loaded
    raises ``MtpWeightsMissingError``. An exception from the refit itself passes unchanged."""

    def __init__(self, model: nn.Module, layers: Mapping[object, str]):
        self.model, self.layers = model, dict(layers)
        self.loaded: set[str] = set()
        self.buckets = 0
        self._shadowed = None

    def _counting(self, load_weights):
        def load_weights_counted(weights: Iterable, *args, **kwargs):
            seen = []

            def passing():
                for name, tensor in weights:
                    seen.append(name)
                    yield name, tensor

            result = load_weights(passing(), *args, **kwargs)
            self.buckets += 1
            # vLLM's load_weights returns the names it loaded; an older one returns None: then
            # the names that went through it
            self.loaded.update(result if result is not None else seen)
            return result

        return load_weights_counted

    def missing(self) -> tuple:
        return tuple(k for k, prefix in self.layers.items()
                     if not any(n.startswith(prefix) for n in self.loaded))

    def __enter__(self) -> MtpRefit:
        self._shadowed = vars(self.model).get("load_weights")
        self.model.load_weights = self._counting(self.model.load_weights)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._shadowed is None:
            del self.model.load_weights
        else:
            self.model.load_weights = self._shadowed
        if exc_type is not None:
            return
        missing = self.missing()
        if missing:
            what = ", ".join(f"{k} (no weight named {self.layers[k]}* loaded)" for k in missing)
            raise MtpWeightsMissingError(
                f"the refit ended without the MTP weights of layer{'s' if len(missing) > 1 else ''}"
                f" {what} in {self.buckets} bucket(s): {type(self.model).__name__} keeps its "
                "previous MTP weights. vLLM >= 0.34 no longer checks this (older vLLM's "
                "load_weights raised 'MTP ... weights missing from checkpoint').", missing)


def mtp_refit_completeness(model: nn.Module, *,
                           layers: Mapping[object, str] | None = None) -> MtpRefit:
    """A context manager around one whole refit of ``model`` (an MTP drafter): raises
    ``MtpWeightsMissingError`` at its end if some MTP layer got no weight in any bucket.
    ``layers``: key -> parameter-name prefix of each MTP layer; by default read from vLLM's MTP
    layout (``model.model.mtp_start_layer_idx``, ``num_mtp_layers``); TypeError when neither
    says."""
    return MtpRefit(model, _mtp_layers(model) if layers is None else layers)
