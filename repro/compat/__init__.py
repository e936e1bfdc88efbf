"""Compatibility matrix: every repro, unfixed and fixed, across released stack combinations.

``python -m repro.compat`` (``tox -m compat``) builds one virtualenv per combination
(``combos.COMBINATIONS``) once, runs ``python -m repro --json`` in each and writes
``benchmarks/results/compat/matrix.json`` and ``matrix.md``. Standard library only here: the
driver needs no torch of its own."""

from repro.compat.combos import COMBINATIONS, Combination
from repro.compat.matrix import CELL_STATUSES, Cell, CombinationResult, Matrix, cells_from_runner
from repro.compat.render import render_markdown

__all__ = ["CELL_STATUSES", "COMBINATIONS", "Cell", "Combination", "CombinationResult", "Matrix",
           "cells_from_runner", "render_markdown"]
