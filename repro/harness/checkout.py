"""The checkout the harness runs from, on the ``PYTHONPATH`` of every interpreter it starts.

The distribution installs only ``fixes``: ``repro``, ``benchmarks`` and ``tests`` are imported
from the checkout (tox sets PYTHONPATH, pytest its ``pythonpath``, ``python -m`` adds the
working directory). A child started in another directory (a test's temporary one) or a fork
server must find them too. The checkout goes last, so a PYTHONPATH that names another checkout
first (``benchmarks.reclaim_overhead`` compares two) still decides. A leaf: it imports nothing
of this repository.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def with_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout on its PYTHONPATH (appended, where it is not there yet)."""
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    if any(os.path.abspath(e) == ROOT for e in entries):
        return dict(env)
    return {**env, "PYTHONPATH": os.pathsep.join([*entries, ROOT])}
