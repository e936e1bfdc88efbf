"""The fork server (repro.harness.forkserver) against a spawned interpreter: a child forked from
it crashes, exits, times out and sees its environment, working directory, argv and sys.path as
a spawned ``python -c`` / ``python -m`` does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from repro import run_isolated
from repro.harness import forkserver, forkserver_process

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not forkserver.enabled(), reason="fork server unavailable here "
                       "(Linux only, or STACKFIX_FORKSERVER=0)"),
]

BOTH = pytest.mark.parametrize("forked", [True, False], ids=["forked", "spawned"])


def _both(**kw):
    """The same child through the fork server and spawned: (forked, spawned) results."""
    return run_isolated(forkserver=True, **kw), run_isolated(forkserver=False, **kw)


def test_a_forked_child_starts_with_torch_imported_a_spawned_one_without():
    code = "import sys; print('torch' in sys.modules)"
    forked, spawned = _both(code=code, timeout=120)
    assert (forked.stdout, spawned.stdout) == ("True\n", "False\n")


def test_the_torchtitan_profile_forks_with_torchtitan_imported():
    pytest.importorskip("torchtitan.trainer", reason="torchtitan not installed")
    r = run_isolated(code="import sys; print('torchtitan.trainer' in sys.modules)",
                     forkserver="torchtitan", timeout=120)
    assert r.stdout == "True\n", r  # the server started: single-threaded after its imports


def test_off_switch_spawns(monkeypatch):
    monkeypatch.setenv(forkserver.ENV, "0")
    r = run_isolated(code="import sys; print('torch' in sys.modules)", forkserver=True)
    assert r.stdout == "False\n"


def test_segfault_is_the_same_signal():
    forked, spawned = _both(code="import ctypes; ctypes.string_at(0)", timeout=120)
    for r in (forked, spawned):
        assert r.signal == signal.SIGSEGV and not r.ok, r
        assert "Fatal Python error: Segmentation fault" in r.stderr  # PYTHONFAULTHANDLER


def test_exit_status_output_and_uncaught_exceptions_are_the_same():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    forked, spawned = _both(code=code, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (spawned.returncode, spawned.stdout, spawned.stderr) == (3, "out\n", "err\n")
    forked, spawned = _both(code="raise ValueError('boom')", timeout=120)
    assert forked.returncode == spawned.returncode == 1
    assert forked.stderr == spawned.stderr  # the traceback starts at the child's own frame
    forked, spawned = _both(code="import sys; sys.exit('a message')", timeout=120)
    assert (forked.returncode, forked.stderr) == (spawned.returncode, spawned.stderr) == \
        (1, "a message\n")


def test_atexit_handlers_and_threads_finish_before_exit():
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n")
    forked, spawned = _both(code=code, timeout=120)
    assert forked.stdout == spawned.stdout == "thread\natexit\n"


def test_env_cwd_argv_and_sys_path_are_the_requests(tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "only_here.py").write_text("X = 1\n")
    code = ("import os, sys, only_here\n"
            "print(os.getcwd(), os.environ['STACKFIX_T'], 'OTHER' in os.environ, sys.argv,"
            " sys.path[0], sys.path[1])")
    kw = dict(code=code, args=["a", "b"], cwd=str(tmp_path), timeout=120,
              env={"STACKFIX_T": "v", "PYTHONPATH": str(extra)})
    os.environ["OTHER"] = "1"
    try:
        forked, spawned = _both(**kw)
    finally:
        del os.environ["OTHER"]
    assert forked.ok and forked.stdout == spawned.stdout, (forked, spawned)
    assert forked.stdout.split()[:3] == [str(tmp_path), "v", "True"]


def test_omp_num_threads_sizes_torchs_pool_as_when_spawned():
    code = "import torch; print(torch.get_num_threads())"
    for env in ({"OMP_NUM_THREADS": "1"}, {}):
        forked, spawned = _both(code=code, env=env, timeout=120)
        assert forked.ok and forked.stdout == spawned.stdout, (env, forked, spawned)


def test_module_runs_as_main_with_its_argv(tmp_path):
    (tmp_path / "as_main.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    forked, spawned = _both(module="as_main", args=["x"], cwd=str(tmp_path), timeout=120)
    assert forked.stdout == spawned.stdout == "__main__ ['x']\n", (forked, spawned)


@BOTH
def test_timeout_kills_the_child_and_what_it_started(forked, tmp_path):
    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    r = run_isolated(code=code, timeout=1.5, forkserver=forked)
    assert r.timed_out and r.returncode is None and time.monotonic() - start < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed with the child's process group; reaped by init
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


@BOTH
def test_output_held_open_by_what_the_child_started_times_out(forked):
    # The child exits at once; the sleeper it started keeps its stdout open: subprocess's
    # communicate() times out on that, and so must the fork server's client.
    code = ("import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n")
    start = time.monotonic()
    r = run_isolated(code=code, timeout=1.5, forkserver=forked)
    assert r.timed_out and r.returncode is None and time.monotonic() - start < 30


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_child_leads_its_own_process_group_and_runs_single_threaded():
    code = ("import os\n"
            "print(os.getpgrp() == os.getpid(), len(os.listdir('/proc/self/task')))")
    r = run_isolated(code=code, forkserver=True, timeout=120)
    assert r.stdout == "True 1\n", r


def test_the_server_refuses_to_fork_with_a_second_thread_or_cuda(monkeypatch):
    monkeypatch.setattr(forkserver_process, "_os_threads", lambda: 2)
    assert forkserver_process._unsafe_to_fork() == "the fork server has 2 threads, not 1"
    monkeypatch.setattr(forkserver_process, "_os_threads", lambda: 1)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert forkserver_process._unsafe_to_fork() == "CUDA is initialised in the fork server"


RANKS = ("import os, sys, time\n"
         "from repro.harness import forkserver\n"
         "from repro.harness.isolated import run_loopback_ranks\n"
         "rank = {rank!r}\n"
         "ranks = run_loopback_ranks([sys.executable, '-c', rank], 2, timeout=60,"
         " forkserver=forkserver.attached())\n"
         "print(forkserver.attached(), os.getpgrp(), *(r.stdout.strip() for r in ranks))\n")


def test_a_forked_childs_ranks_are_forked_into_its_process_group():
    code = RANKS.format(rank="import os, sys; print(os.getpgrp(), 'torch' in sys.modules)")
    forked, spawned = _both(code=code, timeout=120)
    for r, attached, preloaded in ((forked, "True", "True"), (spawned, "False", "False")):
        assert r.ok, r.stderr[-3000:]
        was_attached, group, *ranks = r.stdout.split()
        assert was_attached == attached
        assert ranks == [group, preloaded] * 2, r.stdout


@BOTH
def test_a_timed_out_child_takes_its_ranks_with_it(forked, tmp_path):
    rank = (f"import os, time; open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w')"
            ".write(str(os.getpid())); time.sleep(60)")
    r = run_isolated(code=RANKS.format(rank=rank), timeout=3, forkserver=forked)
    assert r.timed_out
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    for _ in range(50):
        if not any(_alive(pid) for pid in pids):
            break
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
