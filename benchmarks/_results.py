"""Reading pytest-benchmark JSON (a run, or a committed baseline -- the same format) into the
figures the gate and the dashboard compare. Standard library only.

Every benchmark here stores in ``extra_info``: ``scenario``, ``strategy``, ``device_kind`` and
its figures as numbers (``peak_bytes``, ``end_of_backward_bytes``, ``recompute_flops``,
``step_time_ratio``...). A figure's unit follows from its name's suffix (``UNITS``). A timed
figure also stores each interleaved repeat it is the median of, as a list under
``<figure>_repeats`` (``REPEATS_SUFFIX``; ``benchmarks._spread`` reads them).

Where a figure was measured: the file's ``commit_info``, unless the benchmark entry carries its
own ``measured`` record (``{"commit", "dirty", "datetime", "file"}``), as a baseline's rows do
once ``python -m benchmarks.gate --refresh`` has replaced them from a later run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

IDENTITY_KEYS = ("scenario", "strategy", "device_kind")
CRASHED_KEY = "crashed"  # extra_info: the name of what ended a strategy that crashes (SIGSEGV)
# Suffix -> unit; the first match wins. Figures ending in a MEMORY_SUFFIXES entry are gated.
UNITS = (("_bytes", "bytes"), ("_flops", "FLOPs"), ("_ratio", "x"), ("_s", "s"))
MEMORY_SUFFIXES = ("_bytes",)
REPEATS_SUFFIX = "_repeats"
MEASURED_KEY = "measured"  # a benchmark entry's own provenance (benchmarks._baseline.refresh)


def unit_of(metric: str) -> str:
    for suffix, unit in UNITS:
        if metric.endswith(suffix):
            return unit
    return ""


def is_memory_metric(metric: str) -> bool:
    return metric.endswith(MEMORY_SUFFIXES)


def is_time_metric(metric: str) -> bool:
    """A step time or a ratio of step times: noise on a shared machine unless shown with the
    spread of its repeats."""
    unit = unit_of(metric)
    return unit == "s" or (unit == "x" and "time" in metric)


class ResultsError(ValueError):
    """A results file that is not pytest-benchmark JSON with this suite's extra_info."""


@dataclass(frozen=True, slots=True)
class Row:
    """One benchmark's figures."""

    scenario: str
    strategy: str
    device_kind: str
    metrics: dict[str, float]
    name: str = ""
    env: dict[str, str] = field(default_factory=dict)  # torch_version, megatron_core_version...
    crashed: str | None = None
    repeats: dict[str, tuple[float, ...]] = field(default_factory=dict)  # figure -> each repeat
    commit: str = ""  # the commit that measured these figures ("" where unknown)
    source: str = ""  # the file they were read from

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.device_kind, self.scenario, self.strategy)


@dataclass(frozen=True, slots=True)
class Run:
    """One results file: where it came from, when, at which commit, and its rows.

    ``commit`` is the full id ("" where git could not answer), ``dirty`` whether the tree had
    uncommitted changes; ``label`` the short commit (``+dirty``) or, without a commit, the
    file's name; ``skipped`` the benchmarks that skipped (``benchmarks.skipped``)."""

    path: str
    label: str
    datetime: str
    rows: list[Row] = field(default_factory=list)
    commit: str = ""
    dirty: bool = False
    python_version: str = ""
    skipped: list[dict] = field(default_factory=list)

    @property
    def date(self) -> str:
        """``YYYY-MM-DD HH:MM`` of the run (UTC as pytest-benchmark writes it), or ""."""
        return self.datetime[:16].replace("T", " ")

    def by_key(self) -> dict[tuple[str, str, str], Row]:
        return {row.key: row for row in self.rows}

    @property
    def device_kinds(self) -> list[str]:
        return sorted({row.device_kind for row in self.rows})


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _repeats(extra: dict) -> dict[str, tuple[float, ...]]:
    out = {}
    for key, value in extra.items():
        if key.endswith(REPEATS_SUFFIX) and isinstance(value, list) and value \
                and all(_is_number(v) for v in value):
            out[key.removesuffix(REPEATS_SUFFIX)] = tuple(float(v) for v in value)
    return out


def _commit_id(commit_info: dict) -> str:
    """pytest-benchmark writes id "unknown" where git could not answer (e.g. a copied tree)."""
    commit_id = str(commit_info.get("id") or "")
    return "" if commit_id == "unknown" else commit_id


def row_from_benchmark(bench: dict, *, commit: str = "", source: str = "") -> Row:
    extra = bench.get("extra_info") or {}
    name = bench.get("fullname") or bench.get("name") or "?"
    missing = [k for k in IDENTITY_KEYS if not isinstance(extra.get(k), str) or not extra[k]]
    if missing:
        raise ResultsError(f"benchmark {name} has no {', '.join(missing)} in extra_info")
    metrics = {k: float(v) for k, v in extra.items() if k not in IDENTITY_KEYS and _is_number(v)}
    env = {k: v for k, v in extra.items()
           if k not in (*IDENTITY_KEYS, CRASHED_KEY) and isinstance(v, str)}
    crashed = extra.get(CRASHED_KEY)
    measured = bench.get(MEASURED_KEY)
    if isinstance(measured, dict):
        commit = _commit_id({"id": measured.get("commit")})
    return Row(extra["scenario"], extra["strategy"], extra["device_kind"], metrics, name, env,
               str(crashed) if crashed else None, _repeats(extra), commit, source)


def run_from_json(data: dict, *, path: str = "") -> Run:
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ResultsError(f"{path or 'input'}: not pytest-benchmark JSON (no 'benchmarks' list)")
    commit = data.get("commit_info") or {}
    commit_id = _commit_id(commit)
    rows = [row_from_benchmark(b, commit=commit_id, source=path) for b in data["benchmarks"]]
    seen: dict[tuple[str, str, str], str] = {}
    for row in rows:
        if row.key in seen:
            raise ResultsError(
                f"{path or 'input'}: {row.key} is reported twice ({seen[row.key]} and {row.name})"
            )
        seen[row.key] = row.name
    label = commit_id[:8]
    if label and commit.get("dirty"):
        label += "+dirty"
    if not label:
        label = Path(path).stem if path else "run"
    machine = data.get("machine_info") or {}
    skipped = [s for s in data.get("skipped") or [] if isinstance(s, dict)]
    return Run(path=path, label=label, datetime=str(data.get("datetime") or ""), rows=rows,
               commit=commit_id, dirty=bool(commit.get("dirty")),
               python_version=str(machine.get("python_version") or ""), skipped=skipped)


def load_run(path: str | Path) -> Run:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e})") from None
    return run_from_json(data, path=str(path))
