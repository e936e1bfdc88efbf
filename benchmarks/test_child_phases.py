"""``python -m benchmarks.child_phases`` and ``python -m benchmarks.sanitizer_per_op``: what
they report comes from the children they ran (repro.child's REPRO-TIMES line, the probe's
phases), a path a signal ends has no split, and bad input is refused naming what is allowed."""

from __future__ import annotations

import json

import pytest

from benchmarks import child_phases, sanitizer_per_op
from repro.harness import forkserver

pytestmark = pytest.mark.cpu


def test_each_path_reports_its_split_unless_a_signal_ended_it(tmp_path, capsys):
    out = tmp_path / "phases.json"
    assert child_phases.main(["--probes", "1", "--only", "shared-view-reclaim",
                              "--only", "mesh-recompute", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["repro"], r["path"]): r for r in data["paths"]}
    assert set(rows) == {(n, p) for n in ("shared-view-reclaim", "mesh-recompute")
                         for p in ("unfixed", "fixed")}
    crashed = rows["shared-view-reclaim", "unfixed"]
    assert crashed["ended"] == "killed by SIGSEGV" and "run" not in crashed
    for key in (("shared-view-reclaim", "fixed"), ("mesh-recompute", "unfixed"),
                ("mesh-recompute", "fixed")):
        row = rows[key]
        assert row["ended"] == ("exit 1" if key[1] == "unfixed" else "exit 0"), row
        parts = [row[k] for k in ("start", "module", "run", "exit")]
        assert all(p >= 0 for p in parts[1:3]) and row["run"] > 0, row
        assert sum(parts) == pytest.approx(row["wall"], abs=1e-6)
    spawned = data["probes"]["spawned"]
    assert spawned["import torch"] > 0.05 and spawned["total"] > spawned["import torch"]
    if forkserver.enabled():  # the forked probe found torch imported already
        assert data["probes"]["forked"]["import torch"] < spawned["import torch"]
        assert "torch" in data["probes"]["preloads"]
    assert "each repro path on cpu" in capsys.readouterr().out


def test_child_phases_refuses_an_unknown_repro(capsys):
    with pytest.raises(SystemExit) as exit_:
        child_phases.main(["--only", "nosuch"])
    assert exit_.value.code == 2
    assert "unknown repro nosuch; known: mesh-recompute, " in capsys.readouterr().err


def test_sanitizer_per_op_reports_every_mode_and_refuses_too_few_ops(tmp_path):
    out = tmp_path / "per-op.json"
    assert sanitizer_per_op.main(["--ops", "20", "--reps", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ops"] == 20 and data["step_s"] > 0
    assert list(data["us_per_op_side"]) == [
        "pass-through mode", "recompute_sanitizer(values='none')",
        "recompute_sanitizer(values='sampled')", "recompute_sanitizer(values='all')"]
    with pytest.raises(SystemExit) as exit_:
        sanitizer_per_op.main(["--ops", "1"])
    assert exit_.value.code == 2
