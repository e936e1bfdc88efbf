"""The harness itself: isolation of crashes, outcome judging, the runner's CLI contract."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from repro import Repro, Signature, discover, run_isolated
from repro.__main__ import TABLE_WIDTH, exit_status, summary, table
from repro.registry import EXCEPTION_MARKER, SKIP_EXIT_CODE, SKIP_MARKER
from repro.runner import PathOutcome, ReproOutcome, judge_fixed, judge_unfixed

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parent.parent


def test_segfault_is_contained_and_reported_as_signal():
    r = run_isolated(code="import ctypes; ctypes.string_at(0)", timeout=60)
    assert r.signal == signal.SIGSEGV and r.signal_name == "SIGSEGV"
    assert not r.ok


def test_timeout_kills_child():
    r = run_isolated(code="import time; time.sleep(60)", timeout=1)
    assert r.timed_out and r.returncode is None and "timed out" in r.describe()


def test_exit_code_and_output_are_returned():
    r = run_isolated(code="import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert (r.returncode, r.stdout.strip(), r.stderr.strip()) == (3, "out", "err")


def test_run_isolated_needs_exactly_one_target():
    with pytest.raises(ValueError, match="exactly one"):
        run_isolated()
    with pytest.raises(ValueError, match="exactly one"):
        run_isolated(code="pass", module="json")


def _exc_stderr(types, message):
    return "Traceback...\n" + EXCEPTION_MARKER + json.dumps({"types": types, "message": message})


def _fake_repro(*sigs):
    return Repro(name="x", summary="x", run=lambda fixed, device: None, signatures=sigs)


def _result(code, stderr=""):
    from repro.harness.isolated import IsolatedResult

    return IsolatedResult(returncode=code, stdout="", stderr=stderr, seconds=0.1)


def test_signature_matches_exception_in_mro_and_message():
    repro = _fake_repro(Signature(exception="RuntimeError", message="requires an active mesh"))
    hit = _result(1, _exc_stderr(["SpmdTypeError", "RuntimeError", "Exception"],
                                 "assert_type(...) requires an active mesh, but no current mesh is set"))
    assert judge_unfixed(repro, hit, "cpu").status == "reproduced"
    other = _result(1, _exc_stderr(["ValueError", "Exception"], "requires an active mesh"))
    assert judge_unfixed(repro, other, "cpu").status == "wrong-failure"
    assert judge_unfixed(repro, _result(0), "cpu").status == "not-reproduced"


def test_failure_detail_is_whole_and_its_table_row_one_line():
    repro = _fake_repro(Signature(exception="RuntimeError"))
    message = "requires an active mesh.\n\n   Use set_mesh()" + " more" * 60
    stderr = _exc_stderr(["SpmdTypeError", "RuntimeError"], message)
    path = judge_unfixed(repro, _result(1, stderr), "cpu")
    assert path.detail == "SpmdTypeError: " + message  # whole, for --json
    row = table([ReproOutcome("x", "cpu", path, PathOutcome("passed", "completed", 0.0))])
    assert "requires an active mesh. Use set_mesh() more" in row and len(row.splitlines()) == 3


def test_signature_by_signal_and_device():
    repro = _fake_repro(Signature(signal=signal.SIGSEGV, devices=("cpu",)),
                        Signature(stderr="an illegal memory access", devices=("cuda",)))
    assert judge_unfixed(repro, _result(-11), "cpu").status == "reproduced"
    assert judge_unfixed(repro, _result(-11), "cuda").status == "wrong-failure"
    cuda = judge_unfixed(repro, _result(1, "CUDA error: an illegal memory access"), "cuda")
    assert cuda.status == "reproduced"


def test_fixed_path_must_exit_zero():
    assert judge_fixed(_result(0)).status == "passed"
    assert judge_fixed(_result(-11)).status == "failed"


def test_a_child_that_cannot_run_is_skipped_with_its_reason_never_good():
    repro = _fake_repro(Signature(signal=signal.SIGSEGV))
    child = _result(SKIP_EXIT_CODE, "x\n" + SKIP_MARKER + "verl 0.8.0 is not installed")
    for path in (judge_unfixed(repro, child, "cpu"), judge_fixed(child)):
        assert (path.status, path.detail) == ("skipped", "verl 0.8.0 is not installed")
    # The exit code alone is not a skip: a crash that happens to exit 77 stays a failure.
    assert judge_fixed(_result(SKIP_EXIT_CODE)).status == "failed"


def _outcome(name, unfixed, fixed, detail="d", device="cpu"):
    return ReproOutcome(name, device, PathOutcome(unfixed, detail, 1.0),
                        PathOutcome(fixed, detail, 1.0))


def test_outcome_status_and_exit_codes():
    good = _outcome("a", "reproduced", "passed")
    novariant = _outcome("b", "skipped", "skipped", "no cpu variant")
    missing = _outcome("c", "skipped", "skipped", "missing verl")
    half = _outcome("d", "reproduced", "skipped", "needs 2 GPUs")
    bad = _outcome("e", "reproduced", "failed")
    assert [o.status for o in (good, novariant, missing, half, bad)] == [
        "good", "skipped", "skipped", "skipped", "bad"]
    assert good.as_dict()["status"] == "good" and "good" not in missing.as_dict()
    assert exit_status([good, novariant, missing], asked=[], strict=False) == 0
    assert exit_status([good, novariant], asked=[], strict=True) == 0  # no variant: not asked
    assert exit_status([good, missing], asked=[], strict=True) == 3
    assert exit_status([novariant], asked=["b"], strict=False) == 3
    assert exit_status([missing, bad], asked=["c"], strict=False) == 1
    # --allow-skip: under --strict, only the repros named may skip
    assert exit_status([good, missing], asked=[], strict=True, allowed=("c",)) == 0
    assert exit_status([good, missing, half], asked=[], strict=True, allowed=("c",)) == 3
    text = summary([good, novariant, bad])
    assert text.startswith("1 good, 1 bad, 1 skipped") and "  b: no cpu variant" in text


def test_skip_summary_says_each_reason_once_one_line_each():
    why = "STACKFIX_MEGATRON_LM is not set (clone: git clone -b dev ...)"
    outcomes = [_outcome("m1", "skipped", "skipped", why), _outcome("a", "reproduced", "passed"),
                _outcome("m2", "skipped", "skipped", why),
                _outcome("c", "skipped", "skipped", "no cpu variant")]
    lines = summary(outcomes).splitlines()
    assert lines[1:] == ["skipped:", f"  m1, m2: {why}", "  c: no cpu variant"]


def test_table_cell_keeps_the_part_the_signature_matched():
    repro = _fake_repro(Signature(exception="SpmdTypeError", message="requires an active mesh"))
    message = ("assert_type(tensor, PerMeshAxisLocalSpmdType.R) requires an active mesh, but no "
               "current mesh is set. Use set_mesh() or pass an explicit per-axis dict instead.")
    path = judge_unfixed(repro, _result(1, _exc_stderr(["SpmdTypeError", "Exception"], message)),
                         "cpu")
    assert path.detail == "SpmdTypeError: " + message  # whole, for --json
    row = table([ReproOutcome("mesh-recompute", "cpu", path,
                              PathOutcome("passed", "completed", 0.0))]).splitlines()[-1]
    assert len(row) <= TABLE_WIDTH
    assert "SpmdTypeError: …requires an active mesh" in row


def test_table_fits_its_width_and_keeps_names_whole():
    long = _outcome("shared-view-reclaim-megatron", "reproduced", "passed", "RuntimeError: " + "x" * 500)
    for line in table([long, _outcome("a", "skipped", "skipped", "no cpu variant")]).splitlines():
        assert len(line) <= TABLE_WIDTH
    assert "shared-view-reclaim-megatron" in table([long])


def test_cli_reports_a_skipped_repro_as_skipped_and_exits_3(tmp_path):
    out = tmp_path / "o.json"
    res = run_isolated(module="repro", forkserver=True, timeout=120,
                       args=["--only", "mesh-recompute-device-thread", "--json", str(out)])
    assert res.returncode == 3, res.stderr
    assert "0 good, 0 bad, 1 skipped" in res.stdout and "no cpu variant" in res.stdout
    assert "[skipped]" in res.stderr
    assert [o["status"] for o in json.loads(out.read_text())] == ["skipped"]


def test_cli_rejects_an_unwritable_json_path_before_running_anything(tmp_path):
    res = run_isolated(module="repro", forkserver=True, timeout=120,
                       args=["--only", "mesh-recompute", "--json", str(tmp_path / "no" / "o.json")])
    assert res.returncode == 2 and "does not exist" in res.stderr and "[" not in res.stderr


def test_bad_declarations_raise_value_error():
    with pytest.raises(ValueError, match="at least one"):
        Signature()
    with pytest.raises(ValueError, match="allowed"):
        Signature(signal=11, devices=("tpu",))
    with pytest.raises(ValueError, match="no failure signature"):
        _fake_repro()


def test_every_repro_declares_a_complete_contract():
    repros = discover()
    assert {"mesh-recompute", "shared-view-reclaim", "mtp-shape"} <= set(repros)
    for r in repros.values():
        assert r.summary and r.signatures and r.devices


def test_cli_list_and_bad_arguments():
    listed = run_isolated(module="repro", forkserver=True, args=["--list"], timeout=120)
    assert listed.ok, listed.stderr
    for name in discover():
        assert name in listed.stdout
    nosuch = run_isolated(module="repro", forkserver=True, args=["--only", "nosuch"], timeout=120)
    assert nosuch.returncode == 2 and "unknown repro 'nosuch'" in nosuch.stderr
    baddev = run_isolated(module="repro", forkserver=True, args=["--device", "tpu"], timeout=120)
    assert baddev.returncode == 2 and "allowed: cpu, cuda" in baddev.stderr


def test_loopback_ranks_get_torchrun_env_and_time_out_together():
    from repro.harness.isolated import run_loopback_ranks

    code = ("import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'],"
            " os.environ['MASTER_PORT'], os.environ['GLOO_SOCKET_IFNAME'], os.environ['EXTRA'])")
    ranks = run_loopback_ranks([sys.executable, "-c", code], 2, timeout=60, env={"EXTRA": "x"})
    lines = [r.stdout.split() for r in ranks]
    assert [r.ok for r in ranks] == [True, True]
    assert [ln[0] for ln in lines] == ["0", "1"] and lines[0][1:] == lines[1][1:]
    assert lines[0][1:3] == ["2", "127.0.0.1"] and lines[0][4:] == ["lo", "x"]
    slow = run_loopback_ranks([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout=2)
    assert all(r.timed_out for r in slow)


def test_sanitized_runs_are_judged_by_the_sanitized_signatures():
    repro = Repro(name="x", summary="x", run=lambda fixed, device: None,
                  signatures=(Signature(signal=signal.SIGSEGV),),
                  sanitized_signatures=(Signature(exception="ReleasedStorageError"),))
    named = _result(1, _exc_stderr(["ReleasedStorageError", "RuntimeError"], "freed"))
    assert judge_unfixed(repro, named, "cpu", sanitized=True).status == "reproduced"
    assert judge_unfixed(repro, named, "cpu").status == "wrong-failure"
    segv = judge_unfixed(repro, _result(-11), "cpu", sanitized=True)
    assert segv.status == "wrong-failure" and "expected ReleasedStorageError" in segv.detail
    # A repro that declares none is judged as without the sanitizers.
    plain = _fake_repro(Signature(signal=signal.SIGSEGV))
    assert judge_unfixed(plain, _result(-11), "cpu", sanitized=True).status == "reproduced"


def test_a_failed_rank_passes_its_own_exception_to_the_child():
    from repro.harness.ranks import raise_for_ranks
    from repro.registry import ReportedFailure, exception_report, reported_exception

    ok = _result(0)
    failed = _result(1, _exc_stderr(["MeshLostError", "RuntimeError"], "no mesh"))
    with pytest.raises(ReportedFailure, match="rank 1: MeshLostError: no mesh") as info:
        raise_for_ranks([ok, failed])
    # What the child prints for it is the rank's report, so signatures match the rank's type.
    assert reported_exception(EXCEPTION_MARKER + exception_report(info.value))["types"][0] == \
        "MeshLostError"
    with pytest.raises(RuntimeError, match="a rank failed: .*killed by SIGSEGV"):
        raise_for_ranks([ok, _result(-11)])
    raise_for_ranks([ok, ok])


@pytest.mark.deep
def test_cli_sanitize_runs_children_under_the_sanitizers(tmp_path):
    out = tmp_path / "o.json"
    res = run_isolated(module="repro", forkserver=True, timeout=300,
                       args=["--sanitize", "--only", "shared-view-reclaim", "--json", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "under fixes.sanitize" in res.stdout and "(cpu, sanitized)" in res.stderr
    [row] = json.loads(out.read_text())
    assert row["sanitized"] is True and row["status"] == "good"
    detail = row["unfixed"]["detail"]
    assert detail.startswith("ReleasedStorageError: aten.mul.Tensor at repro/shared_view_reclaim.py:")
    assert "would access freed memory" in detail


@pytest.mark.parametrize("value, names", [
    ("", ()), ("0", ()), ("off", ()), ("No", ()), ("false", ()),
    ("1", ("storage", "mesh")), ("true", ("storage", "mesh")), ("ON", ("storage", "mesh")),
    ("storage,recompute", ("storage", "recompute")),
])
def test_the_sanitize_switch_takes_on_off_or_a_list(monkeypatch, value, names):
    from repro.harness.sanitize import ENV, requested

    monkeypatch.setenv(ENV, value)
    assert requested() == names


def test_a_sanitize_value_that_names_no_sanitizer_is_refused_naming_what_is_allowed(monkeypatch):
    from repro.harness.sanitize import ENV, requested

    monkeypatch.setenv(ENV, "storage,bogus")
    with pytest.raises(ValueError) as error:
        requested()
    assert str(error.value) == (
        "STACKFIX_SANITIZE='storage,bogus': unknown sanitizer(s) ['bogus']; allowed: a "
        "comma-separated list of storage, mesh, recompute, or on (storage,mesh) / off: on is 1, "
        "true, yes or on; off is 0, false, no or off (any case)")


def test_the_suite_stops_at_once_on_a_bad_harness_variable():
    r = run_isolated(module="pytest", args=["--collect-only", "-q", "-p", "no:cacheprovider",
                                            "-p", "no:xdist", "tests/test_switch.py"],
                     env={"STACKFIX_SANITIZE": "bogus"}, cwd=str(ROOT), timeout=120)
    assert r.returncode == 4, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "ERROR: STACKFIX_SANITIZE='bogus': unknown sanitizer(s) ['bogus']" in r.stderr


@pytest.mark.cpu
def test_setup_megatron_leaves_the_environment_as_it_found_it():
    # Its world-size-1 rendezvous once went through os.environ (MASTER_ADDR / MASTER_PORT): a
    # process that set megatron up in-process (a pytest worker) handed its store's port to
    # every child it started after, whose own init_process_group then failed with EADDRINUSE.
    # A MASTER_PORT the caller set is still the one used; with none, no port at all: a port
    # probed free and then listened on is a race with every other process on the host (one
    # H200 refresh lost a session's cells to EADDRINUSE from eleven sessions side by side).
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    code = textwrap.dedent("""
        import json, os, sys
        import torch.distributed as dist
        from repro.harness.isolated import free_loopback_port
        from repro.harness.megatron_world import setup_megatron
        given = sys.argv[1] == "given"
        if given:
            os.environ["MASTER_PORT"] = str(free_loopback_port())
        before = dict(os.environ)
        setup_megatron("cpu")
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # the PrefixStore over the store made
            store = store.underlying_store
        print("RESULT", json.dumps({"same_env": dict(os.environ) == before,
                                    "store": type(store).__name__,
                                    "port": getattr(store, "port", None),
                                    "given": os.environ.get("MASTER_PORT")}))
    """)
    for case in ("free", "given"):
        r = run_isolated(code=code, args=[case], timeout=120, cwd=str(ROOT), forkserver=True)
        assert r.ok, r.stderr[-3000:]
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        got = json.loads(line[len("RESULT "):])
        assert got["same_env"], got
        if case == "given":
            assert str(got["port"]) == got["given"], got
        else:
            assert (got["store"], got["port"]) == ("HashStore", None), got
