"""``python -m benchmarks.child_phases``, ``sanitizer_per_op`` and ``proc_cpu``: what
they report comes from the children they ran (repro.child's REPRO-TIMES line, the probe's
phases), a path a signal ends has no split, and bad input is refused naming what is allowed."""

from __future__ import annotations

import json
import sys

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


def test_proc_cpu_sums_exactly_the_cpu_of_what_the_command_starts(tmp_path, capsys):
    import resource

    from benchmarks import proc_cpu

    out = tmp_path / "cpu.json"
    # a child that burns 0.6 s of CPU in a grandchild, then exits 3
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\n"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])\nsys.exit(3)\n"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc_cpu.main(["--json", str(out), "--interval", "0.05", "--",
                          sys.executable, "-c", code]) == 3
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    data = json.loads(out.read_text())
    # the rows sum to what the kernel counted for the command's tree, however late the last
    # sample came (each row is rounded to 0.01 s), and that holds the burn
    reaped = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert data["cpu_s"] == pytest.approx(reaped, abs=0.005 * len(data["groups"]) + 0.01), data
    assert data["cpu_s"] >= 0.6, data
    burner = [g for g in data["groups"] if g["role"].startswith("python -c import time")]
    assert burner and burner[0]["processes"] == 1, data
    assert data["groups"][-1]["role"] == "not attributed"
    assert data["exit_status"] == 3 and data["processes"] == 2
    assert "in all; wall" in capsys.readouterr().out
    for bad, says in ((["--"], "no command given"),
                      (["--interval", "0", "--", "true"], "--interval must be > 0")):
        with pytest.raises(SystemExit):
            proc_cpu.main(bad)
        assert says in capsys.readouterr().err


def test_proc_cpu_gives_each_exited_process_its_tail_from_its_reapers_counters(monkeypatch):
    """The accounting on a scripted /proc, sample by sample: a tail no sample saw is what the
    reaper's reaped-children counters grew by less what was seen of the processes it reaped."""
    from benchmarks import proc_cpu

    # pid: (ppid, own CPU s, reaped children's CPU s); None: listed, then gone before its read
    steps = [
        {10: (1, .1, 0), 11: (10, .2, 0), 12: (10, .1, 0), 13: (12, .3, 0)},
        # 11 reaped (it used .5 in all): its tail .3 is exact
        {10: (1, .1, .5), 12: (10, .1, 0), 13: (12, .4, 0)},
        # 12 and 13 gone together: 10's counters grew by both (.15 + .5); the .15 no sample saw
        # is split by what each was seen to use (.1 : .4)
        {10: (1, .1, 1.15)},
        # .2 from a child no sample saw: not attributed
        {10: (1, .1, 1.35), 15: (10, .1, 0)},
        # 15 listed, then reaped during the sample: 10 was read either side of it, so 10 waits
        {10: (1, .1, 1.65), 15: None},
        {10: (1, .1, 1.65)},
    ]
    sampler = proc_cpu.Sampler(root=10)
    for step in steps:
        monkeypatch.setattr(proc_cpu, "_listed", lambda step=step: set(step))
        monkeypatch.setattr(proc_cpu, "_read", lambda pid, step=step: None if step[pid] is None
                            else (step[pid][0], pid, step[pid][1], step[pid][2], f"p{pid}"))
        sampler.sample()
        if step is steps[4]:
            assert sampler.procs[15].tail == 0  # not settled while 10's read may predate the reap
    monkeypatch.setattr(proc_cpu, "_listed", set)
    sampler.sample()
    sampler.settle(proc_cpu._US, 1.77)  # wait4: the root's .12 and the 1.65 it reaped
    got = {pid: round(p.total, 6) for pid, p in sampler.procs.items()}
    assert got == {10: .12, 11: .5, 12: .13, 13: .52, 15: .3}
    assert sampler.not_attributed == pytest.approx(.2)
    assert sum(got.values()) + sampler.not_attributed == pytest.approx(1.77)
