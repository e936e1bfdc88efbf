"""Upstream checkouts as matrix cells: a clone of torchtitan or Megatron-LM at any commit, in
place of the released package, as a user with network access would test after ``git clone``::

    git clone https://github.com/pytorch/torchtitan && git -C torchtitan checkout <commit>
    python -m repro.compat --checkout torchtitan=torchtitan [--base COMBINATION]

The cell is the base combination (default: the first of ``combos.COMBINATIONS`` whose Python the
project supports) with the released requirement replaced by ``<name> @ file://<checkout>`` in the
same pip resolver run, named ``<base>-<project>-<commit[:8]>``; the runner is the same
``python -m repro --json``. A repro "reproduced" there means the crash is still in that upstream
commit (as far as the repro reaches upstream code: its one-line summary says what it runs).

verl checkouts are not cells: the repros load verl *releases* by version (``repro.verl_release``).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

from repro.compat.combos import COMBINATIONS, Combination

# project -> the pip distribution its checkout builds, which it replaces in the base combination
PROJECTS = {"torchtitan": "torchtitan", "megatron-lm": "megatron-core"}
# megatron-core 0.17+ (and Megatron-LM main) require Python >= 3.12
_MIN_PYTHON = {"megatron-lm": "3.12"}


def is_upstream_cell(name: str) -> bool:
    """Whether a matrix column is a checkout cell (``<base>-<project>-<commit[:8]>``)."""
    return re.search(rf"-(?:{'|'.join(PROJECTS)})-[0-9a-f]{{8}}$", name) is not None


def checkout_commit(path: Path) -> str:
    """The checkout's HEAD commit (40 hex digits); ValueError when ``path`` is not a git
    checkout (a cell must name the commit it measured)."""
    done = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    commit = done.stdout.strip()
    if done.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"{path}: not a git checkout (git rev-parse HEAD: "
                         f"{(done.stderr or done.stdout).strip()[:200]})")
    return commit


def parse_checkout(spec: str) -> tuple[str, Path]:
    """``NAME=PATH`` -> (project, absolute path); ValueError naming what is allowed."""
    name, sep, path = spec.partition("=")
    if not sep or name not in PROJECTS:
        raise ValueError(f"--checkout {spec!r}: expected NAME=PATH with NAME one of "
                         f"{', '.join(PROJECTS)} (verl checkouts are not cells: the repros load "
                         "verl releases by version)")
    where = Path(path).expanduser().resolve()
    if not (where / "pyproject.toml").is_file():
        raise ValueError(f"--checkout {spec!r}: {where} has no pyproject.toml")
    return name, where


def _default_base(project: str) -> Combination:
    need = _MIN_PYTHON.get(project)
    return next(c for c in COMBINATIONS if need is None or c.python >= need)


def upstream_combination(project: str, checkout: Path, base: Combination | None = None,
                         ) -> tuple[Combination, str]:
    """The cell for ``checkout`` of ``project`` on ``base``, and the checkout's commit."""
    base = base or _default_base(project)
    dist = PROJECTS[project]
    commit = checkout_commit(checkout)
    kept = tuple(p for p in base.packages if re.split(r"[=<>!~ @\[;]", p, maxsplit=1)[0].lower() != dist)
    combo = dataclasses.replace(base, name=f"{base.name}-{project}-{commit[:8]}",
                                packages=(*kept, f"{dist} @ file://{checkout}"))
    return combo, commit
