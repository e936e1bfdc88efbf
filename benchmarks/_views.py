"""Which run the dashboard shows for each scenario, and its history.

Contract:
- ``committed_runs`` keeps the runs of a clean tree. A run whose tree was dirty is left out
  unless ``include_dirty`` (then its label carries ``+dirty``). A run whose commit git could not
  name (a copied tree) is kept, labelled ``commit?`` with its date: nothing says it was dirty.
- ``scenario_views``: per (device kind, scenario) the runs that have rows of *that scenario on
  that kind*, oldest first. The latest of those is the section's latest run, the one before it
  is "previous". A newer run of other scenarios or another kind never blanks a section.
- ``superseded``: a scenario's view on one GPU card whose latest run is older than the latest
  run of the same scenario on another card, with that card and run: the figures a reader
  should read are the newer card's (the device lends an H100 or an H200, whichever comes; one
  card's sections are never current beside the other's).
- ``ScenarioView.strategies``: the strategies of the scenario's family (the name before
  ``/``) on that kind, so a strategy one variant lacks still has a row.
- ``ScenarioView.env_changes``: the history points whose environment (torch, megatron-core,
  GPU, Python) differs from the point before, with what changed; ``code_changes``: those where a
  memory figure moved beyond a tolerance in the same environment, naming the two commits.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks._results import Row, Run, is_memory_metric

ENV_KEYS = (("torch_version", "torch"), ("megatron_core_version", "megatron-core"),
            ("gpu_name", "GPU"), ("python", "Python"))


def sorted_runs(runs: list[Run]) -> list[Run]:
    return sorted(runs, key=lambda r: r.datetime)  # ISO timestamps sort as text; stable otherwise


def committed_runs(runs: list[Run], *, include_dirty: bool = False) -> tuple[list[Run], list[Run]]:
    """(runs shown, dirty-tree runs left out), oldest first."""
    kept = [r for r in runs if include_dirty or not r.dirty]
    return sorted_runs(kept), sorted_runs([r for r in runs if r not in kept])


def short_label(run: Run) -> str:
    """Short commit (``+dirty``) and date, e.g. ``ab6f670c 11-30 14:49``: distinct per run
    where the commit repeats, readable where git could not name the commit."""
    commit = run.commit[:8] + ("+dirty" if run.dirty else "") if run.commit else "commit?"
    return f"{commit} {run.date[5:]}".strip()


@dataclass(frozen=True, slots=True)
class Point:
    """One run's rows of one scenario on one kind: strategy -> row."""

    run: Run
    rows: dict[str, Row]
    label: str

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for row in self.rows.values():
            for key, _ in ENV_KEYS:
                if key in row.env:
                    env.setdefault(key, row.env[key])
        if self.run.python_version:
            env["python"] = self.run.python_version
        return env


@dataclass(frozen=True, slots=True)
class ScenarioView:
    kind: str
    scenario: str
    history: list[Point]
    strategies: list[str]
    baseline: dict[str, Row] = field(default_factory=dict)

    @property
    def latest(self) -> Point:
        return self.history[-1]

    @property
    def previous(self) -> Point | None:
        return self.history[-2] if len(self.history) > 1 else None

    @property
    def metrics(self) -> list[str]:
        return sorted({m for p in self.history for r in p.rows.values() for m in r.metrics})

    def code_changes(self, tolerance: float) -> list[tuple[int, str]]:
        """History points where a memory figure moved by more than ``tolerance`` (relative)
        while the environment stayed the same: what changed is the code between the two
        commits; the note names them."""
        out = []
        env_changed = {i for i, _ in self.env_changes}
        for i in range(1, len(self.history)):
            before, now = self.history[i - 1], self.history[i]
            if i in env_changed:
                continue
            moved = sorted({m for s, row in now.rows.items() if s in before.rows
                            for m, v in row.metrics.items() if is_memory_metric(m)
                            and (b := before.rows[s].metrics.get(m)) and abs(v - b) > tolerance * abs(b)})
            if moved:
                a, c = before.run.commit[:8] or "?", now.run.commit[:8] or "?"
                out.append((i, f"{', '.join(moved)} moved by more than {tolerance:.1%} with the same "
                               f"environment: the code between {a} and {c} (git log {a}..{c})"))
        return out

    @property
    def env_changes(self) -> list[tuple[int, str]]:
        out = []
        for i in range(1, len(self.history)):
            before, now = self.history[i - 1].env, self.history[i].env
            changed = [f"{name} {before.get(k, '?')} -> {now.get(k, '?')}" for k, name in ENV_KEYS
                       if before.get(k) != now.get(k) and (k in before or k in now)]
            if changed:
                out.append((i, ", ".join(changed)))
        return out


def _distinct(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def scenario_views(runs: list[Run], baselines: dict[str, Run] | None = None) -> list[ScenarioView]:
    """One view per (device kind, scenario) of ``runs`` (already filtered), sorted by both."""
    runs = sorted_runs(runs)
    keys = sorted({(r.device_kind, r.scenario) for run in runs for r in run.rows})
    views = []
    for kind, scenario in keys:
        family = scenario.split("/")[0]
        strategies: list[str] = []
        points = []
        for run in runs:
            for r in run.rows:
                if (r.device_kind == kind and r.scenario.split("/")[0] == family
                        and r.strategy not in strategies):
                    strategies.append(r.strategy)
            rows = {r.strategy: r for r in run.rows if (r.device_kind, r.scenario) == (kind, scenario)}
            if rows:
                points.append((run, rows))
        labels = _distinct([short_label(run) for run, _ in points])
        history = [Point(run, rows, label) for (run, rows), label in zip(points, labels, strict=True)]
        base = (baselines or {}).get(kind)
        base_rows = ({} if base is None else
                     {r.strategy: r for r in base.rows if (r.device_kind, r.scenario) == (kind, scenario)})
        views.append(ScenarioView(kind, scenario, history, strategies, base_rows))
    return views


GPU_PREFIX = "gpu-"


def is_gpu(kind: str) -> bool:
    return kind.startswith(GPU_PREFIX)


def current_gpu_view(views: list[ScenarioView], scenario: str) -> ScenarioView | None:
    """The view of ``scenario`` on the GPU card whose latest run of it is the newest (None
    where no card ran it)."""
    on_gpus = [v for v in views if v.scenario == scenario and is_gpu(v.kind)]
    return max(on_gpus, key=lambda v: v.latest.run.datetime, default=None)


def superseded(views: list[ScenarioView]) -> dict[tuple[str, str], tuple[str, str]]:
    """(kind, scenario) -> (the card, the run's label) of a newer run of that scenario on
    another GPU card, for each GPU view it supersedes (strictly older: two cards' runs of
    one time supersede neither)."""
    out = {}
    for v in views:
        now = current_gpu_view(views, v.scenario) if is_gpu(v.kind) else None
        if now is not None and now.latest.run.datetime > v.latest.run.datetime:
            out[(v.kind, v.scenario)] = (now.kind, now.latest.label)
    return out
