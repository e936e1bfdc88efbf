"""What a dashboard reader compares a strategy's figure with: no reclaim and each verl release.

The benchmark families name the same strategies differently (``recompute-reclaim``: ``unsafe`` /
``mtp-skip``; ``megatron-scale``: ``verl-0.8.0`` / ``verl-0.9.1``); ``REFERENCES`` maps each
reference (a column of the page and of the README table) to the names it goes by.
``STRATEGY_NOTES`` says on the page what every name means; ``display_name`` is what a section
shows for one (the headline's names). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks._results import Row

# column title -> the strategy names that are that reference, in any family
REFERENCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("no reclaim", ("none",)),
    ("verl 0.8.0", ("unsafe", "verl-0.8.0")),
    ("verl 0.9.1", ("mtp-skip", "verl-0.9.1")),
)
# the rival fixes of the #3221 leak (repro.reclaims.RIVALS), in the families that measure them
RIVALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Megatron-LM #6339", ("megatron-6339",)),
    ("miles #2862 gc.collect", ("gc-collect",)),
)
RIVAL_FAMILIES = ("megatron-scale",)
SUBJECT = "ours"
# The first reference is each family's "none": what its title says there.
NONE_TITLES = {"activation-checkpoint": "no checkpointing", "sanitizers": "no sanitizer",
               "recompute-sanitizer": "no sanitizer"}
STRATEGY_NOTES = {
    "none": "no reclaim / no activation checkpointing / no sanitizer: the reference",
    "unsafe": "verl 0.8.0's released reclaim: resize_(0) of every checkpoint input and its grad "
              "(crashes on a chunk view's shared storage)",
    "verl-0.8.0": "verl 0.8.0's released reclaim",
    "mtp-skip": "verl 0.9.1's released reclaim: verl 0.8.0's, skipped for checkpoints that close "
                "over a MultiTokenPredictionLayer",
    "verl-0.9.1": "verl 0.9.1's released reclaim",
    "megatron-6339": "Megatron-LM #6339 (open PR): .grad = None on the checkpoint's detached "
                     "inputs after backward (the inputs stay where a graph keeps them)",
    "gc-collect": "radixark/miles #2862: gc.collect() after each recomputed backward (frees what "
                  "a reference cycle holds, not what a reachable graph keeps)",
    "ours": "fixes.megatron.apply_recompute_reclaim_patch: the release-unheld reclaim",
    "selective": "torchtitan's selective activation checkpointing",
    "full": "full activation checkpointing",
    "+mesh_ctx": "suffix: with fixes.torchtitan.mesh_preserving_context_fn",
    "multithreaded": "autograd's default device threads in backward",
    "single-threaded": "fixes.torchtitan.single_threaded_backward",
    "storage": "fixes.sanitize.storage_sanitizer", "mesh": "fixes.sanitize.mesh_sanitizer",
    "storage-slow-path": "storage_sanitizer with a released storage alive (every op checked)",
}


@dataclass(frozen=True, slots=True)
class Versus:
    """``value`` against ``reference``: ratio (value / reference) and difference."""

    value: float
    reference: float

    @property
    def ratio(self) -> float | None:
        return None if self.reference == 0 else self.value / self.reference

    @property
    def difference(self) -> float:
        return self.value - self.reference


def reference_rows(rows: dict[str, Row]) -> list[tuple[str, Row | None]]:
    """Per reference column present in the family of ``rows`` (strategy -> row): its row, or
    None where that strategy has no row in this run."""
    out = []
    for title, names in REFERENCES:
        row = next((rows[n] for n in names if n in rows), None)
        out.append((title, row))
    return out


def reference_title(title: str, family: str) -> str:
    """A reference column's title in ``family``: ``no reclaim`` is ``no checkpointing`` for the
    activation-checkpoint benchmarks, ``no sanitizer`` for the sanitizers'."""
    return NONE_TITLES.get(family, title) if title == REFERENCES[0][0] else title


# The names the README's headline gives the verl releases' reclaims (the benchmarks' own names:
# STRATEGY_NOTES); "none" is named as its family's reference column is (``reference_title``).
DISPLAY_NAMES = {"unsafe": "verl 0.8.0", "verl-0.8.0": "verl 0.8.0",
                 "mtp-skip": "verl 0.9.1", "verl-0.9.1": "verl 0.9.1"}


def display_name(strategy: str, family: str) -> str:
    """What a section calls ``strategy``: a verl release's reclaim by the release (as the
    headline does), ``none`` by what it is in ``family`` ("no reclaim", "no sanitizer", ...)."""
    if strategy == REFERENCES[0][1][0]:
        return reference_title(REFERENCES[0][0], family)
    return DISPLAY_NAMES.get(strategy, strategy)


def versus(row: Row | None, reference: Row | None, metric: str) -> Versus | None:
    """``row`` vs ``reference`` on ``metric``; None when either lacks it (or crashed)."""
    if row is None or reference is None:
        return None
    a, b = row.metrics.get(metric), reference.metrics.get(metric)
    return None if a is None or b is None else Versus(a, b)


def main_pair(strategies: list[str]) -> tuple[str, str] | None:
    """The comparison a section's one-line summary shows: ``ours`` (else the last strategy)
    against ``none`` (else the first one) -- a ``base+suffix`` strategy against ``base``;
    None with fewer than two strategies."""
    if len(strategies) < 2:
        return None
    subject = SUBJECT if SUBJECT in strategies else strategies[-1]
    base = subject.rsplit("+", 1)[0]
    if base != subject and base in strategies:  # "full+mesh_ctx": what the suffix costs
        return subject, base
    reference = "none" if "none" in strategies and subject != "none" else strategies[0]
    return None if subject == reference else (subject, reference)


def note_for(strategy: str) -> str:
    if strategy in STRATEGY_NOTES:
        return STRATEGY_NOTES[strategy]
    base, _, suffix = strategy.partition("+")
    if suffix and "+" + suffix in STRATEGY_NOTES and base in STRATEGY_NOTES:
        return f"{STRATEGY_NOTES[base]}, {STRATEGY_NOTES['+' + suffix].split(': ', 1)[-1]}"
    parts = strategy.split("+")
    if len(parts) > 1 and all(p in STRATEGY_NOTES for p in parts):
        return " and ".join(STRATEGY_NOTES[p] for p in parts)
    return ""
