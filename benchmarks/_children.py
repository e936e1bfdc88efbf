"""The megatron-scale children one pytest session needs, planned from what it selected, and
started together at the first cell a test asks for.

Why: a child pays an interpreter and megatron-core's import (~16 s on the H200 host alone,
twice that beside the refresh's other sessions) before it measures anything -- a spawned
one; ``cells_in_child`` forks it now -- and a session
ran its six strategies' children one after the other: the refresh's longest sessions took
~300 s, most of it waiting (``benchmarks/results/evidence/2026-12-04-h200-refresh/``). So

* one child per (device, strategy, expert-parallel ranks, size), every model of the selection
  in it (``benchmarks.megatron_scale.cells_in_child`` with several models): the step-time
  gate's session runs one child, not three;
* where the session already shares the GPU with other sessions (``SHARED_GPU`` set: its step
  times are not gated there) up to ``AT_ONCE`` children run together -- memory figures are
  per process and unchanged by a neighbour; a child that ran out of device memory there runs
  once more -- and anywhere else one at a time, so that a child's step times never measure
  another child's work.

A cell the plan did not foresee (a test reading a strategy its ``reads`` does not name) is
measured when asked for, as before: slower, never wrong.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

# children together in a session sharing the GPU: three each in the refresh's six megatron
# sessions ran the H200 out of memory (a 2048x4096 child holds ~12 GiB, a 1024x2048 one ~4 GiB,
# beside the stack sessions' ~36 GiB; 9f4d346)
AT_ONCE = 2


@dataclass(frozen=True)
class Need:
    """One cell a selected test reads: (device, model, strategy, ep, hidden, seq)."""

    device: str
    model: str
    strategy: str
    ep: int
    hidden: int
    seq: int

    def child(self) -> tuple[str, str, int, int, int]:
        return (self.device, self.strategy, self.ep, self.hidden, self.seq)


def plan(needs: Iterable[Need]) -> dict[tuple, list[str]]:
    """Child key (device, strategy, ep, hidden, seq) -> its models, in the order first needed."""
    children: dict[tuple, list[str]] = {}
    for need in needs:
        models = children.setdefault(need.child(), [])
        if need.model not in models:
            models.append(need.model)
    return children


@dataclass
class Children:
    """The planned children of a session, started at the first ``cells`` call (``measure``:
    child key and models -> that child's cells as dicts, each with its ``model``)."""

    needs: list[Need]
    measure: Callable[[tuple, list[str]], list[dict]]
    at_once: int = 1
    retried: list[tuple] = field(default_factory=list)  # children run again after an OOM
    _plan: dict[tuple, list[str]] = field(default_factory=dict)
    _futures: dict[tuple, Future] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None

    def _start(self) -> None:
        self._plan = plan(self.needs)
        self._pool = ThreadPoolExecutor(max_workers=max(self.at_once, 1),
                                        thread_name_prefix="megatron-child")
        for key, models in self._plan.items():
            self._futures[key] = self._pool.submit(self._measure, key, models)

    def _measure(self, key: tuple, models: list[str]) -> list[dict]:
        """``measure``, once more where it ran out of device memory beside other children
        (what the neighbours held then, not what the child needs)."""
        got = self.measure(key, models)
        if self.at_once > 1 and any("OutOfMemoryError" in str(c.get("error")) for c in got):
            self.retried.append(key)
            # to the process's stderr: the session's log, whatever pytest captures
            print(f"megatron-scale child {key} ran out of device memory beside others: "
                  "running it once more", file=sys.__stderr__, flush=True)
            got = self.measure(key, models)
        return got

    def cells(self, need: Need) -> list[dict]:
        """The cells of ``need``'s model from its child (errors included, as the child gave
        them); a cell nobody planned is measured now, in a child of its own."""
        if self._pool is None:
            self._start()
        if need.model not in self._plan.get(need.child(), ()):
            # through the pool: never beside more children than ``at_once``
            return self._pool.submit(self._measure, need.child(), [need.model]).result()
        got = self._futures[need.child()].result()
        mine = [c for c in got if c.get("model") == need.model]
        # a child that died answers with one error cell (no ``hidden``) for all its models
        return mine or [c for c in got if "hidden" not in c]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def at_once(shared_gpu_variable: str, device: str) -> int:
    """``AT_ONCE`` on CUDA where the session shares the GPU (``shared_gpu_variable`` set), else
    1."""
    return AT_ONCE if device == "cuda" and os.environ.get(shared_gpu_variable) else 1
