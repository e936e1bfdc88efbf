"""The matrix: per combination, per repro, one cell built from ``python -m repro --json``.

A cell is ``ok`` (unfixed reproduced, fixed passed), ``failed`` (either path did not), ``skipped``
(the runner's reason kept), ``could-not-run`` (skipped for something the combination leaves out
on purpose, or the runner itself died) or ``could-not-install`` (pip's last line). Skipped never counts as
good; each path's own status and detail are kept beside the verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

CELL_STATUSES = ("ok", "failed", "skipped", "could-not-run", "could-not-install")
SCHEMA = 1


@dataclass(frozen=True, slots=True)
class Cell:
    status: str
    reason: str = ""
    unfixed: dict | None = None  # the runner's {"status", "detail", "seconds"} of each path
    fixed: dict | None = None

    def __post_init__(self):
        if self.status not in CELL_STATUSES:
            raise ValueError(f"cell status must be one of {CELL_STATUSES}, got {self.status!r}")


def cell_from_outcome(outcome: dict, absent: dict[str, str] | None = None) -> Cell:
    """One runner outcome (``ReproOutcome.as_dict()``) as a cell. ``absent``: what the
    combination leaves out on purpose (a module, "verl 0.8.0") -> why; a repro whose skip reason
    names it ("missing torchtitan") could not run, for that why."""
    try:
        unfixed, fixed = dict(outcome["unfixed"]), dict(outcome["fixed"])
        statuses = unfixed["status"], fixed["status"]
        details = unfixed.get("detail", ""), fixed.get("detail", "")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a runner outcome (needs unfixed/fixed with status): {outcome!r}") from exc
    if "skipped" in statuses:
        reason = details[statuses.index("skipped")]
        whys = [why for what, why in (absent or {}).items() if what in reason]
        if whys:
            return Cell("could-not-run", "; ".join(whys), unfixed, fixed)
        return Cell("skipped", reason, unfixed, fixed)
    if statuses == ("reproduced", "passed"):
        return Cell("ok", "", unfixed, fixed)
    bad = [f"{path} {s}: {d}" for path, s, d, good in zip(
        ("unfixed", "fixed"), statuses, details, ("reproduced", "passed"), strict=True) if s != good]
    return Cell("failed", "; ".join(bad), unfixed, fixed)


def cells_from_runner(outcomes: list, absent: dict[str, str] | None = None) -> dict[str, Cell]:
    if not isinstance(outcomes, list):
        raise ValueError(f"runner JSON must be a list of outcomes, got {type(outcomes).__name__}")
    cells = {}
    for outcome in outcomes:
        name = outcome.get("name") if isinstance(outcome, dict) else None
        if not name:
            raise ValueError(f"runner outcome without a name: {outcome!r}")
        cells[name] = cell_from_outcome(outcome, absent)
    return cells


@dataclass(slots=True)
class CombinationResult:
    """One combination's run: what was asked, what got installed, when, and its cells."""

    name: str
    python: str
    requested: list[str]
    verl: str
    date: str
    installed: dict[str, str] = field(default_factory=dict)
    install_seconds: float = 0.0
    run_seconds: float = 0.0
    reused_venv: bool = False
    commit: str = ""  # the checkout the repros ran from
    cells: dict[str, Cell] = field(default_factory=dict)
    failure: Cell | None = None  # could-not-install / could-not-run: every repro's cell

    def __post_init__(self):
        if self.failure is not None and self.failure.status not in ("could-not-install",
                                                                    "could-not-run"):
            raise ValueError(f"{self.name}: a combination failure is could-not-install or "
                             f"could-not-run, got {self.failure.status!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CombinationResult:
        try:
            cells = {k: Cell(**v) for k, v in data["cells"].items()}
            failure = Cell(**data["failure"]) if data.get("failure") else None
            return cls(**{**data, "cells": cells, "failure": failure})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a combination result: {exc}") from exc


@dataclass(slots=True)
class Matrix:
    generated: str
    commit: str
    device: str = "cpu"
    combinations: list[CombinationResult] = field(default_factory=list)
    summaries: dict[str, str] = field(default_factory=dict)  # repro -> its one-line summary

    @property
    def repros(self) -> list[str]:
        """Every repro named by any combination, in first-seen order (the registry's)."""
        names: dict[str, None] = {}
        for combo in self.combinations:
            names.update(dict.fromkeys(combo.cells))
        return list(names)

    def cell(self, combination: str, repro: str) -> Cell:
        combo = next(c for c in self.combinations if c.name == combination)
        if combo.failure is not None:
            return combo.failure
        return combo.cells.get(repro) or Cell(
            "could-not-run", "not in this combination's run (an older registry)")

    def problems(self) -> list[str]:
        """``combination/repro`` of every failed cell, and each combination that could not
        install: what a regeneration must flag."""
        found = []
        for c in self.combinations:
            if c.failure is not None and c.failure.status == "could-not-install":
                found.append(f"{c.name}/*")
            found += [f"{c.name}/{r}" for r in self.repros if self.cell(c.name, r).status == "failed"]
        return found

    def merged(self, newer: Matrix) -> Matrix:
        """This matrix with ``newer``'s combinations replacing (or joining) its own."""
        fresh = {c.name: c for c in newer.combinations}
        have = {c.name for c in self.combinations}
        combos = [fresh.get(c.name, c) for c in self.combinations]  # replaced in place
        combos += [c for c in newer.combinations if c.name not in have]
        return Matrix(newer.generated, newer.commit, newer.device, combos,
                      {**self.summaries, **newer.summaries})

    def ordered(self, combinations) -> Matrix:
        """Columns in the order of ``combinations`` (names it lacks go last)."""
        rank = {c.name: i for i, c in enumerate(combinations)}
        combos = sorted(self.combinations, key=lambda c: rank.get(c.name, len(rank)))
        return Matrix(self.generated, self.commit, self.device, combos, self.summaries)

    def with_missing(self, combinations, reason: str) -> Matrix:
        """This matrix plus a could-not-run column for each of ``combinations`` it lacks."""
        have = {c.name for c in self.combinations}
        missing = [CombinationResult(c.name, c.python, list(c.requirements), c.verl, self.generated,
                                     failure=Cell("could-not-run", reason))
                   for c in combinations if c.name not in have]
        return Matrix(self.generated, self.commit, self.device, self.combinations + missing,
                      self.summaries)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "generated": self.generated, "commit": self.commit,
                "device": self.device, "repros": self.repros,
                "combinations": [c.to_json() for c in self.combinations],
                "summaries": self.summaries}

    @classmethod
    def from_json(cls, data: dict) -> Matrix:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"not a compat matrix of schema {SCHEMA}")
        return cls(data["generated"], data["commit"], data.get("device", "cpu"),
                   [CombinationResult.from_json(c) for c in data["combinations"]],
                   dict(data.get("summaries", {})))
