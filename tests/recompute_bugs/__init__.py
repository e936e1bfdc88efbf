"""Real recompute bugs from public upstream reports, one module per report: each a minimal
faithful repro of the report's mechanism, with its report cited in the module docstring, and
one ``step(variant)`` that trains one step of the same model three ways (``Variant``): the
reference without activation checkpointing, the buggy checkpointed step and the fixed one. A
step returns what it produced (gradients, and the state the report is about) as named
tensors; ``diverges`` compares two bit for bit.

Each module marks the line the buggy recompute departs at with a ``# <- diverges`` comment
(``diverging_lines``; a module whose model lives in a shared helper names it in
``DIVERGES_IN``): the sanitizer's error must name a site on it.

The contract over the corpus is ``tests/test_recompute_bug_corpus.py``.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

MARKER = "# <- diverges"
MODULES = (
    "rrelu_early_stop",
    "batchnorm_stats_twice",
    "shared_indices_overwritten",
    "tokens_per_expert_twice",
    "dropout_rng_not_preserved",
    "randperm_rng_not_restored",
    "autocast_not_reentered",
    "kv_cache_in_recompute",
    "fp8_scale_not_stashed",
    "fp8_restore_by_reference",
)


class Variant(enum.StrEnum):
    REFERENCE = "reference"  # no activation checkpointing
    BUGGY = "buggy"
    FIXED = "fixed"


Result = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Bug:
    name: str
    upstream: str  # "owner/repo#number", the report
    step: Callable[[Variant], Result]
    path: str  # the module's file
    requires: tuple[str, ...] = ()  # optional packages the repro needs

    def diverging_lines(self) -> list[int]:
        """The marked lines of ``path``; a marker may name the report it is for
        (``# <- diverges: TransformerEngine#24``, in a model two reports share)."""
        lines = []
        with open(self.path) as f:
            for n, line in enumerate(f, start=1):
                if MARKER in line:
                    tag = line.split(MARKER, 1)[1].strip().lstrip(":").strip()
                    if not tag or self.upstream.endswith(tag.split("/")[-1]):
                        lines.append(n)
        return lines


def load(name: str) -> Bug:
    module = importlib.import_module(f"{__name__}.{name}")
    path = getattr(module, "DIVERGES_IN", None) or inspect.getsourcefile(module)
    return Bug(name=name, upstream=module.UPSTREAM, step=module.step, path=path,
               requires=getattr(module, "REQUIRES", ()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_floating_point():
        return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            t.element_size()])
    return t


def diverges(a: Result, b: Result) -> list[str]:
    """The names whose tensors differ between ``a`` and ``b`` (bitwise; NaN equals NaN of
    the same bits), or that only one of them has."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].shape != b[n].shape
            or a[n].dtype != b[n].dtype or not torch.equal(_bits(a[n]), _bits(b[n]))]
