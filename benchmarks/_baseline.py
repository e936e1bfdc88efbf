"""The committed baselines (``benchmarks/baselines/<device_kind>.json``, pytest-benchmark JSON)
and their refresh from a run.

Contract of ``refresh_baseline``: the run must name a commit (a clean tree that git could name):
figures belong to the code they were measured on. Per device kind of the run, the baseline
entries of ``keys`` are replaced by the run's (or added), each stamped with where it was
measured (``measured``: commit, dirty, datetime and the file the run is filed as); every other
entry is left byte for byte. The file keeps its own ``commit_info``, which names the commit of
the entries without a ``measured`` record. Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from benchmarks._results import IDENTITY_KEYS, MEASURED_KEY, ResultsError, Row, Run, load_run

BASELINE_DIR = Path(__file__).resolve().parent / "baselines"
Key = tuple[str, str, str]  # (device kind, scenario, strategy), as Row.key


def baseline_path_for(device_kind: str, baseline_dir: Path = BASELINE_DIR) -> Path:
    return Path(baseline_dir) / f"{device_kind}.json"


def load_baselines(
    run: Run, *, baseline: str | Path | None = None, baseline_dir: Path = BASELINE_DIR
) -> list[Row]:
    """The baseline rows for ``run``: from ``baseline`` if given, else one file per device kind
    in the run. Raises ResultsError with what to do when a file is missing."""
    if baseline is not None:
        return load_run(baseline).rows
    rows: list[Row] = []
    for kind in run.device_kinds:
        path = baseline_path_for(kind, baseline_dir)
        if not path.exists():
            raise ResultsError(
                f"no baseline for device kind {kind!r}: {path} does not exist. If this run is "
                f"the reference, create it: python -m benchmarks.gate "
                f"{run.path or 'RESULTS.json'} --refresh"
            )
        rows += [row for row in load_run(path).rows if row.device_kind == kind]
    return rows


def _key(bench: dict) -> Key:
    extra = bench.get("extra_info") or {}
    scenario, strategy, kind = (extra.get(k) for k in IDENTITY_KEYS)
    return (kind, scenario, strategy)


@dataclass(frozen=True, slots=True)
class Refreshed:
    path: Path
    replaced: int
    added: int


def refresh_baseline(run: Run, run_data: dict, keys: Collection[Key], *, filed_as: str,
                     baseline_dir: Path = BASELINE_DIR) -> list[Refreshed]:
    """Replace (or add) the baseline entries of ``keys`` by ``run``'s; see the module docstring."""
    if run.dirty or not run.commit:
        why = "it ran on a dirty tree" if run.dirty else "git could not name its commit"
        raise ResultsError(f"cannot refresh a baseline from {run.path or 'this run'}: {why}; "
                           "commit, then run the benchmarks again")
    measured = {"commit": run.commit, "dirty": False, "datetime": run.datetime, "file": filed_as}
    out = []
    for kind in run.device_kinds:
        entries = [b for b in run_data["benchmarks"] if _key(b)[0] == kind and _key(b) in keys]
        if not entries:
            continue
        path = baseline_path_for(kind, baseline_dir)
        data = json.loads(path.read_text()) if path.exists() else {
            **{k: v for k, v in run_data.items() if k != "benchmarks"}, "benchmarks": []}
        where = {_key(b): i for i, b in enumerate(data["benchmarks"])}
        replaced = added = 0
        for bench in entries:
            stamped = {**bench, MEASURED_KEY: measured}
            if _key(bench) in where:
                data["benchmarks"][where[_key(bench)]] = stamped
                replaced += 1
            else:
                data["benchmarks"].append(stamped)
                added += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=4))  # as pytest-benchmark writes it
        out.append(Refreshed(path, replaced, added))
    return out
