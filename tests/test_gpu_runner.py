"""ci/gpu_run.py, the one runner of the GPU evidence: its targets, bad input, and what a call
leaves under --out (one steps.log with a section per step, run.json with each step's exact
command, exit status and its own seconds, also when the steps run side by side)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
_SPEC = importlib.util.spec_from_file_location(
    "gpu_run", Path(__file__).parent.parent / "ci" / "gpu_run.py")
gpu_run = sys.modules["gpu_run"] = importlib.util.module_from_spec(_SPEC)  # ci/ is no package
_SPEC.loader.exec_module(gpu_run)


def test_every_target_lists_its_commands(capsys):
    assert gpu_run.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for target in ("suite", "reclaim", "megatron-scale", "megatron-unit-tests", "verl-engine"):
        assert f"\n{target}: " in "\n" + listed
    assert gpu_run.main(["--dry-run", "--out", "X", "repro"]) == 0
    assert capsys.readouterr().out.strip() == "python3 -m repro --device cuda --json X/repro-cuda.json"
    # a step by its name, once however often named (a failed session remade alone)
    assert gpu_run.main(["--dry-run", "--out", "X", "repro-cuda", "repro", "pytest-gpu"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "python3 -m repro --device cuda --json X/repro-cuda.json",
        " ".join(gpu_run._steps("X")["suite"][0].argv)]


def test_an_unknown_target_is_refused_naming_the_allowed(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_run.main(["nosuch"])
    assert exit_info.value.code == 2
    assert "unknown target(s) nosuch; allowed: suite, repro," in capsys.readouterr().err


@pytest.mark.parametrize("parallel", [False, True], ids=["one-after-another", "parallel"])
def test_a_call_leaves_one_folded_log_and_its_record(tmp_path, monkeypatch, parallel):
    steps = [gpu_run.Step("slow", ["sh", "-c", "sleep 2; echo done"], 30),
             gpu_run.Step("fails", ["sh", "-c", "echo oops; exit 3"], 30, json="fails.json")]
    monkeypatch.setattr(gpu_run, "_steps", lambda out: {"t": steps})
    monkeypatch.setattr(gpu_run, "TARGETS", ("t",))
    monkeypatch.setenv("STACKFIX_COMMIT", "abc123")
    monkeypatch.setattr(gpu_run, "REPO", tmp_path)  # no .git there: the commit comes from env
    argv = ["--out", str(tmp_path / "out"), "t"] + (["--parallel"] if parallel else [])
    assert gpu_run.main(argv) == 1  # a step failed
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "steps.log"]
    log = (out / "steps.log").read_text()
    assert "===== slow: exit 0 in " in log and "done" in log
    assert "===== fails: exit 3 in " in log and "oops" in log
    record = json.loads((out / "run.json").read_text())
    assert record["commit"] == "abc123" and record["parallel"] is parallel
    slow, fails = record["steps"]
    assert (slow["exit"], fails["exit"]) == (0, 3)
    # each its own time (a bound from the work, not from a quiet machine: both cores may be busy)
    assert slow["seconds"] >= 2.0 and fails["seconds"] < slow["seconds"]
    assert fails["argv"] == ["sh", "-c", "echo oops; exit 3"]


def test_under_parallel_a_step_that_times_runs_alone_before_the_others(tmp_path, monkeypatch):
    # The refresh target's sanitizer step measures step-time ratios: it must not share the GPU
    # with the memory sessions started side by side, nor run on the host they leave behind
    # (host-bound steps 20-100% slower after them on the H200, a 1% gate failed there).
    marks = tmp_path / "marks"

    def step(name, seconds, **kw):
        script = (f"echo {name}-start >> {marks}; sleep {seconds}; "
                  f"echo {name}-end-shared-${{{gpu_run.SHARED_GPU}:-no}} >> {marks}")
        return gpu_run.Step(name, ["sh", "-c", script], 30, **kw)

    steps = [step("timed", 0.1, alone=True), step("a", 1), step("b", 1)]
    monkeypatch.setattr(gpu_run, "_steps", lambda out: {"t": steps})
    monkeypatch.setattr(gpu_run, "TARGETS", ("t",))
    monkeypatch.setenv("STACKFIX_COMMIT", "abc123")
    monkeypatch.setenv(gpu_run.SHARED_GPU, "7")  # a caller's own value reaches no step
    monkeypatch.setattr(gpu_run, "REPO", tmp_path)
    assert gpu_run.main(["--out", str(tmp_path / "out"), "--parallel", "t"]) == 0
    order = marks.read_text().split()
    assert order[:2] == ["timed-start", "timed-end-shared-no"]  # alone, first
    assert sorted(order[2:4]) == ["a-start", "b-start"]  # then a and b together
    # each told how many shared the GPU (a time gate skips there)
    assert sorted(order[4:]) == ["a-end-shared-2", "b-end-shared-2"]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert [r["name"] for r in record["steps"]] == ["timed", "a", "b"]  # records as given


def test_the_refresh_runs_every_benchmark_file():
    # The refresh remakes every published GPU figure: a benchmark file none of its sessions
    # names would publish figures no refresh remakes (they would age silently).
    named = {arg.split("::")[0] for step in gpu_run._steps("OUT")["refresh"]
             for arg in step.argv if arg.startswith("benchmarks/test_bench_")}
    files = {f"benchmarks/{p.name}" for p in (gpu_run.REPO / "benchmarks").glob("test_bench_*.py")}
    assert named == files
    names = [s.name for s in gpu_run._steps("OUT")["refresh"]]
    assert len(names) == len(set(names))  # one log and one JSON each
    # the step-time figures and gates alone on the GPU, before the memory sessions
    assert [s.name for s in gpu_run._steps("OUT")["refresh"] if s.alone] == [
        "bench-gpu-sanitize", "bench-gpu-megatron-steptime-gate", "bench-gpu-fused-print"]
    # refresh-memory and refresh-times split it for a device call's limit, and lose nothing
    split = [s.name for t in ("refresh-memory", "refresh-times") for s in gpu_run._steps("OUT")[t]]
    assert sorted(split) == sorted(names)


def test_the_time_gate_reads_the_variable_the_runner_sets():
    bench = pytest.importorskip("benchmarks.test_bench_megatron_scale")
    assert bench.SHARED_GPU == gpu_run.SHARED_GPU


def test_a_step_name_selects_one_command():
    # a step named on the command line runs the command its name stands for in every target
    # that holds it: one name, one argv (and one log)
    seen: dict[str, gpu_run.Step] = {}
    writes: dict[str, str] = {}
    for target in gpu_run._steps("OUT").values():
        for step in target:
            assert seen.setdefault(step.name, step) == step, step.name
            # and two steps never write one JSON (run together, the second overwrote the first)
            if step.json:
                assert writes.setdefault(step.json, step.name) == step.name, step.json


def test_the_refresh_times_fit_one_device_call():
    # run alone, one after another: their limits together, with ~20 s of set-up, within one
    # call, so that a cut call still leaves its run.json (the first refresh's was lost)
    steps = gpu_run._steps("OUT")["refresh-times"]
    assert all(s.alone for s in steps)
    assert sum(s.timeout for s in steps) + 20 <= gpu_run.CALL_SECONDS


@pytest.mark.parametrize("parallel", [False, True], ids=["one-after-another", "parallel"])
def test_the_calls_limit_cuts_the_steps_still_running_and_keeps_the_record(tmp_path,
                                                                          monkeypatch, parallel):
    # A refresh on a slower H100 host ran past the device call's limit (6c0a6d9: 585 s, two
    # memory sessions still running): the call's timeout killed the runner, and with it the
    # steps.log and run.json it writes at its end. Given --limit, the runner ends what still
    # runs there itself and records each step: cut (exit 124) or never started.
    steps = [gpu_run.Step("quick", ["sh", "-c", "echo quick"], 30),
             gpu_run.Step("long", ["sh", "-c", "echo begun; sleep 60"], 90),
             gpu_run.Step("after", ["sh", "-c", "echo after"], 30)]
    if parallel:  # side by side, "after" waits for room beside "long" (the card's memory)
        steps = [gpu_run.Step(s.name, s.argv, s.timeout, gib=6) for s in steps]
        monkeypatch.setenv(gpu_run.DEVICE_GIB, "10")
    monkeypatch.setattr(gpu_run, "_steps", lambda out: {"t": steps})
    monkeypatch.setattr(gpu_run, "TARGETS", ("t",))
    monkeypatch.setenv("STACKFIX_COMMIT", "abc123")
    monkeypatch.setattr(gpu_run, "REPO", tmp_path)
    argv = ["--out", str(tmp_path / "out"), "--limit", "3", "t"] + (
        ["--parallel"] if parallel else [])
    assert gpu_run.main(argv) == 1
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["limit_s"] == 3
    quick, long, after = record["steps"]
    assert quick["exit"] == 0 and "cut" not in quick
    assert long["exit"] == 124 and long["cut"] == "the call's limit (--limit 3)"
    assert 2 <= long["seconds"] < 30  # ended at the limit, not by its own 90 s
    assert after["exit"] is None and after["cut"] == "not started before the call's limit"
    log = (tmp_path / "out" / "steps.log").read_text()
    assert "===== long: exit 124 in " in log and "begun" in log
    assert "===== after: not started" in log


def test_a_limit_left_under_a_tenth_of_a_second_still_bounds_the_step(tmp_path, monkeypatch):
    # What is left of the limit, rounded to 0.1 s, was 0.0 under 0.05 s; `timeout 0` runs its
    # command with no time limit at all
    steps = [gpu_run.Step("long", ["sh", "-c", "sleep 20"], 90)]
    monkeypatch.setattr(gpu_run, "_steps", lambda out: {"t": steps})
    monkeypatch.setattr(gpu_run, "TARGETS", ("t",))
    monkeypatch.setenv("STACKFIX_COMMIT", "abc123")
    monkeypatch.setattr(gpu_run, "REPO", tmp_path)
    assert gpu_run.main(["--out", str(tmp_path / "out"), "--limit", "0.01", "t"]) == 1
    (long,) = json.loads((tmp_path / "out" / "run.json").read_text())["steps"]
    assert long["exit"] == 124 and long["cut"] == "the call's limit (--limit 0.01)"
    assert long["seconds"] < 10  # cut, not run out by its 20 s sleep


def test_a_limit_that_is_no_positive_number_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_run.main(["--limit", "0", "repro"])
    assert "--limit 0: seconds > 0" in capsys.readouterr().err


def test_what_a_step_leaves_running_is_killed_when_it_ends_and_named_in_its_record(tmp_path,
                                                                                  monkeypatch):
    # A process a step started that outlives it (its own session: no process group reaches
    # it) would load the host while the next steps -- those whose figures are times -- run.
    pidfile = tmp_path / "pid"
    # the step ends once setsid has become the sleep (read before, the process still named
    # itself "setsid sleep 300": under load, the record did -- .ci/run at 2c41fcf)
    left = (f"setsid sleep 300 & echo $! > {pidfile}; "
            "while [ \"$(cat /proc/$!/comm 2>/dev/null)\" != sleep ]; do sleep 0.01; done; "
            "echo started")
    steps = [gpu_run.Step("leaves", ["sh", "-c", left], 30),
             gpu_run.Step("timed", ["sh", "-c", "true"], 30, alone=True)]
    monkeypatch.setattr(gpu_run, "_steps", lambda out: {"t": steps})
    monkeypatch.setattr(gpu_run, "TARGETS", ("t",))
    monkeypatch.setenv("STACKFIX_COMMIT", "abc123")
    monkeypatch.setattr(gpu_run, "REPO", tmp_path)
    assert gpu_run.main(["--out", str(tmp_path / "out"), "--parallel", "t"]) == 0
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    leaves, timed = record["steps"]
    assert [p.split(" ", 1)[1] for p in leaves["left_running"]] == ["sleep 300"]
    assert timed["left_running"] == []
    assert "left running after the step, killed" in (tmp_path / "out" / "steps.log").read_text()
    # the host's load when a step that times started (a quiet machine reads near 0)
    assert isinstance(timed["load_at_start"], float) and "load_at_start" not in leaves


def test_under_parallel_the_sessions_started_together_fit_the_cards_memory(tmp_path, monkeypatch):
    # The refresh's memory sessions side by side held ~130 GiB: they fit the H200 and ran an
    # H100 (80 GB) out of memory -- NCCL's set-up failed in most megatron cells (68d0102). A
    # session waits until what the running ones hold and its own fit the card.
    marks = tmp_path / "marks"

    def step(name, seconds, gib):
        script = f"echo {name}-start >> {marks}; sleep {seconds}; echo {name}-end >> {marks}"
        return gpu_run.Step(name, ["sh", "-c", script], 30, gib=gib)

    steps = [step("a", 1.5, 6), step("b", 0.1, 6), step("c", 0.1, 3)]
    monkeypatch.setattr(gpu_run, "_steps", lambda out: {"t": steps})
    monkeypatch.setattr(gpu_run, "TARGETS", ("t",))
    monkeypatch.setenv("STACKFIX_COMMIT", "abc123")
    monkeypatch.setenv(gpu_run.DEVICE_GIB, "10")
    monkeypatch.setattr(gpu_run, "REPO", tmp_path)
    assert gpu_run.main(["--out", str(tmp_path / "out"), "--parallel", "t"]) == 0
    order = marks.read_text().split()
    # a and c together (6 + 3 <= 10); b only once a has ended (6 + 6 > 10)
    assert order.index("b-start") > order.index("a-end")
    assert order.index("c-start") < order.index("a-end")
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["device_gib"] == 10.0
    assert [r["name"] for r in record["steps"]] == ["a", "b", "c"]
    # a session larger than the card alone still runs (alone), rather than never
    steps[:] = [step("huge", 0.1, 50), step("d", 0.1, 1)]
    (tmp_path / "marks").unlink()
    assert gpu_run.main(["--out", str(tmp_path / "out2"), "--parallel", "t"]) == 0
    assert marks.read_text().split() == ["huge-start", "huge-end", "d-start", "d-end"]


def test_the_card_memory_is_read_from_nvidia_smi_or_the_variable(monkeypatch):
    monkeypatch.setenv(gpu_run.DEVICE_GIB, "80")
    assert gpu_run._device_gib() == 80.0
    monkeypatch.setenv(gpu_run.DEVICE_GIB, "eighty")
    with pytest.raises(ValueError, match=f"{gpu_run.DEVICE_GIB}='eighty'"):
        gpu_run._device_gib()
    monkeypatch.delenv(gpu_run.DEVICE_GIB)
    monkeypatch.setattr(gpu_run.shutil, "which", lambda name: None)
    assert gpu_run._device_gib() is None  # no GPU tool here: no limit
    # every memory session of the refresh declares what it holds, its megatron children as
    # many as a session sharing the GPU runs together
    memory = gpu_run._steps("OUT")["refresh-memory"]
    assert all(s.gib > 0 for s in memory)
    children = pytest.importorskip("benchmarks._children")
    assert gpu_run.AT_ONCE == children.AT_ONCE
    megatron = [s for s in memory if "megatron" in s.name]
    assert {s.gib for s in megatron} == {g * children.AT_ONCE
                                         for g in gpu_run.MEGATRON_CHILD_GIB.values()}


def test_the_sanitizers_gpu_tests_are_a_target_beside_their_figures():
    # after a change under fixes/sanitize/ a device call remakes the figures and runs the
    # sanitizers' gpu tests: both runner targets (no command written by hand per call)
    steps = gpu_run._steps("OUT")
    (tests,) = steps["sanitizer-tests"]
    files = {a for a in tests.argv if a.startswith("tests/")}
    with_gpu = {f"tests/{p.name}" for p in (gpu_run.REPO / "tests").glob("test_sanitize_*.py")
                if "mark.gpu" in p.read_text()}
    assert files == with_gpu and len(files) >= 4
    assert "gpu" in tests.argv and not tests.alone


def test_stale_selects_the_refresh_steps_whose_published_figures_are_older_than_the_code():
    # Run the refresh "whenever a measured path changes": all of it took 529-589 s on an H100
    # where a change under fixes/sanitize/ makes only the sanitizers' two sessions older than
    # the code. A step is chosen where a scenario it makes is older than the code in its
    # newest published GPU run, or where no published run has any of its scenarios.
    refresh = gpu_run._steps("OUT")["refresh"]
    latest = {  # scenario -> the commit of its newest published GPU run
        "recompute-sanitizer/megatron-moe-1024x2048-bf16": "old",
        "sanitizers/plain-transformer-full-ac": "new",
        "sanitizers/fused-print-moe-layer-1024x2048-bf16": "old",
        "megatron-scale/moe/1024x2048/bf16": "new",
        "megatron-scale/moe/2048x4096/fp32": "old",
        "megatron-scale/moe-ep2/1024x2048/bf16": "old",  # two GPUs: no step of the refresh
        "megatron-scale/gpt-mtp/1024x2048/bf16": "new",
        "megatron-scale/gpt-mtp/2048x4096/bf16": "new",
        "megatron-scale/moe-kept-probs/1024x2048/bf16": "new",
        "megatron-scale/moe-kept-probs/2048x4096/bf16": "new",
        "activation-checkpoint/plain-transformer": "new",
        "backward-threads/plain-transformer-full-ac": "new",
        "output-discard/stack": "new",
        "recompute-reclaim/plain": "new",
    }
    chosen = gpu_run.stale_steps(refresh, latest, lambda commit, family: commit == "old")
    assert [s.name for s in chosen] == [  # in the refresh's order (--parallel: times first)
        "bench-gpu-megatron-moe-2048x4096", "bench-gpu-sanitize",
        "bench-gpu-megatron-steptime-gate", "bench-gpu-fused-print"]
    # nothing older: nothing chosen; a step none of whose scenarios was ever published: chosen
    assert gpu_run.stale_steps(refresh, latest, lambda commit, family: False) == []
    del latest["backward-threads/plain-transformer-full-ac"]
    assert [s.name for s in gpu_run.stale_steps(refresh, latest, lambda c, f: False)] == [
        "bench-gpu-backward-threads"]
    # every step of the refresh says which scenarios it makes
    assert all(s.scenarios for s in refresh)


def test_the_stale_target_reads_this_checkouts_published_runs(capsys):
    # at whatever HEAD this runs: the steps chosen are steps of the refresh, each once
    assert gpu_run.main(["--dry-run", "--out", "X", "stale"]) == 0
    printed = capsys.readouterr().out.splitlines()
    refresh = [" ".join(s.argv) for s in gpu_run._steps("X")["refresh"]]
    assert printed == ["nothing older than the code"] or (
        len(set(printed)) == len(printed) and set(printed) <= set(refresh)), printed
