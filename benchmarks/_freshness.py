"""Whether a run is older than the code its figures measure.

Each benchmark family (a scenario's name before ``/``) declares the paths whose code its figures
measure (``MEASURED_PATHS``): the fix it measures and the benchmark's own scenario code. A run is
*older than the code* when ``git diff <run commit> HEAD -- <paths>`` is not empty: that code
changed after the run, so its figures may no longer describe it (a change undone since is no
change; the note names the last commit that touched the paths). The dashboard's sections and
the headline table (and with it the README's) say so, with the paths and the commit of the last
change (``Freshness.note``).

A run whose commit git could not name, or whose commit this checkout's history lacks (a shallow
clone), cannot be tied to the code: it is reported as such, never as current. Standard library
only; every git answer is cached per ``History``.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# family -> the paths its figures measure (a trailing "/": everything below)
MEASURED_PATHS: dict[str, tuple[str, ...]] = {
    # _cell_child: how a cell's child is started (forked: its peak since it initialised CUDA)
    "recompute-reclaim": ("fixes/megatron/", "benchmarks/_reclaim.py",
                          "benchmarks/test_bench_reclaim.py", "benchmarks/_measure.py",
                          "benchmarks/_cell_child.py"),
    # _children: how a session's children are grouped and run together (their step times)
    "megatron-scale": ("fixes/megatron/", "repro/reclaims.py", "benchmarks/megatron_scale.py",
                       "benchmarks/test_bench_megatron_scale.py", "benchmarks/_children.py"),
    "activation-checkpoint": ("fixes/torchtitan/", "benchmarks/_ac.py",
                              "benchmarks/test_bench_activation_checkpoint.py",
                              "benchmarks/_measure.py"),
    "backward-threads": ("fixes/torchtitan/", "benchmarks/_ac.py",
                         "benchmarks/test_bench_backward_threads.py", "benchmarks/_measure.py"),
    # the plain transformer's sanitizer cells and the fused print of one MoE layer's side
    "sanitizers": ("fixes/sanitize/", "benchmarks/_ac.py", "benchmarks/test_bench_sanitize.py",
                   "benchmarks/fused_print.py", "benchmarks/test_bench_fused_print.py"),
    "recompute-sanitizer": ("fixes/sanitize/", "benchmarks/_sanitize_megatron.py",
                            "benchmarks/test_bench_sanitize.py"),
    "output-discard": ("fixes/megatron/output_discard.py", "benchmarks/_output_discard.py",
                       "benchmarks/test_bench_output_discard.py", "benchmarks/_measure.py",
                       "benchmarks/_cell_child.py"),
    # the compatibility matrix (benchmarks/results/compat/): every repro and every fix
    "compat": ("fixes/", "repro/"),
}


class Age(StrEnum):
    CURRENT = "current"
    OLDER = "older than the code"
    UNKNOWN_COMMIT = "commit unknown"
    NOT_IN_HISTORY = "commit not in this history"
    NO_HISTORY = "no git history"
    NO_PATHS = "no measured paths declared"


class History:
    """Answers from one checkout's git history (cached)."""

    def __init__(self, repo: Path = REPO):
        self.repo = Path(repo)

    def _git(self, *args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(self.repo), *args], capture_output=True,
                               text=True, check=False)
        except OSError:
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    @functools.cache  # noqa: B019 -- one History per page build; the cache is the point
    def head(self) -> str:
        return self._git("rev-parse", "HEAD") or ""

    @functools.cache  # noqa: B019
    def has(self, commit: str) -> bool:
        return self._git("cat-file", "-e", f"{commit}^{{commit}}") is not None

    @functools.cache  # noqa: B019
    def differs(self, since: str, paths: tuple[str, ...]) -> bool:
        """Whether any of ``paths`` differs between ``since`` and HEAD (a change undone since
        is none)."""
        return bool(self._git("diff", "--name-only", since, "HEAD", "--", *paths))

    @functools.cache  # noqa: B019
    def last_change(self, since: str, paths: tuple[str, ...]) -> str:
        """The newest commit after ``since`` (up to HEAD) that touched any of ``paths``, or ""."""
        return self._git("log", "-1", "--format=%H", f"{since}..HEAD", "--", *paths) or ""


@dataclass(frozen=True, slots=True)
class Freshness:
    """How a run's commit stands to the last change of the paths its figures measure."""

    age: Age
    run_commit: str
    head: str = ""
    changed: tuple[str, ...] = ()  # the measured paths that changed after the run
    last_change: str = ""  # the newest commit that changed one of them

    @property
    def stale(self) -> bool:
        return self.age is not Age.CURRENT

    def note(self) -> str:
        """The sentence a section shows."""
        run = self.run_commit[:8]
        if self.age is Age.OLDER:
            return (f"run at {run}, older than the last change to {', '.join(self.changed)} "
                    f"at {self.last_change[:8]}")
        if self.age is Age.CURRENT:
            return f"run at {run}: no change since to the code it measures"
        if self.age is Age.UNKNOWN_COMMIT:
            return "run at an unknown commit (git could not name it): its figures cannot be tied to the code"
        if self.age is Age.NOT_IN_HISTORY:
            return (f"run at {run}, a commit this checkout's history lacks (a shallow clone?): "
                    "cannot tell whether the code changed since")
        if self.age is Age.NO_HISTORY:
            return f"run at {run or 'an unknown commit'}: no git history here to compare with"
        return f"run at {run or 'an unknown commit'}: no measured paths declared for this benchmark"

    def short(self) -> str:
        """The headline table's (and the README's) words: "" for a current run. No paths or
        commits: those are the section's, and the README's table changes only when a run's
        age does."""
        return "" if self.age is Age.CURRENT else str(self.age)


def freshness(run_commit: str, family: str, history: History | None = None) -> Freshness:
    """Whether the run at ``run_commit`` is older than the code ``family`` measures."""
    history = history or History()
    paths = MEASURED_PATHS.get(family)
    if not paths:
        return Freshness(Age.NO_PATHS, run_commit)
    if not run_commit:
        return Freshness(Age.UNKNOWN_COMMIT, run_commit)
    head = history.head()
    if not head:
        return Freshness(Age.NO_HISTORY, run_commit)
    if not history.has(run_commit):
        return Freshness(Age.NOT_IN_HISTORY, run_commit, head)
    if not history.differs(run_commit, paths):
        return Freshness(Age.CURRENT, run_commit, head)
    changed = tuple(p for p in paths if history.differs(run_commit, (p,)))
    return Freshness(Age.OLDER, run_commit, head, changed, history.last_change(run_commit, paths))
