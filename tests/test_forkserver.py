"""The fork server (repro.harness.forkserver) against a spawned interpreter: a child forked from
it crashes, exits, times out and sees its environment, working directory, argv and sys.path as
a spawned ``python -c`` / ``python -m`` does."""

from __future__ import annotations

import os
import re
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


def test_the_spmd_profile_forks_without_megatron_and_prestart_starts_the_server_it_uses():
    """``python -m repro`` prestarts its repros' servers (their imports overlap the parent's);
    the mesh repros' profile preloads no megatron-core, so it is ready sooner."""
    forkserver.prestart(["spmd"])
    deadline = time.monotonic() + 120
    while "spmd" not in forkserver._servers and time.monotonic() < deadline:
        time.sleep(0.05)
    started = forkserver._servers["spmd"]  # the prestart thread's server, starting or ready
    r = run_isolated(code="import sys; print('spmd_types' in sys.modules, "
                          "'megatron.core' in sys.modules)", forkserver="spmd", timeout=120)
    assert r.stdout == "True False\n", r
    assert forkserver._servers["spmd"] is started  # run() used it, started no other
    with pytest.raises(ValueError, match=r"unknown fork server profile 'nosuch'; known: "):
        forkserver.prestart(["nosuch"])


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


@pytest.fixture
def own_servers(monkeypatch):
    """This process's fork servers replaced by none (each test starts its own); those it
    started are closed afterwards and the previous ones put back."""
    monkeypatch.setattr(forkserver, "_servers", {})
    monkeypatch.setattr(forkserver, "_unavailable", {})
    yield forkserver._servers
    for client in list(forkserver._servers.values()):
        client.close()


@pytest.mark.deep
def test_a_profile_that_extends_another_is_forked_from_that_ones_server(own_servers):
    # torch's preloads extend spmd's, torchtitan's torch's: such a server is forked from the
    # one below it and imports only what it adds (the shared imports' CPU is paid once).
    code = ("import sys; print(*(m in sys.modules "
            "for m in ('spmd_types', 'megatron.core.tensor_parallel')))")
    r = run_isolated(code=code, forkserver="torch", timeout=120)
    spmd, torch = own_servers["spmd"], own_servers["torch"]
    assert _parent(torch.session) == spmd.session  # forked from the spmd server
    assert os.getsid(torch.session) == torch.session  # in a session of its own
    # megatron-core where installed, and where importing it leaves the server able to fork
    # (on a CUDA machine it starts a driver thread: that server preloads the modules before it)
    megatron = (forkserver_process.importlib.util.find_spec("megatron") is not None
                and "megatron.core.tensor_parallel" in torch.preloads)
    assert r.ok and r.stdout == f"True {megatron}\n", r
    # A forked server ends when its client's connection closes.
    torch.close()
    assert not forkserver._running(torch.session) and forkserver._running(spmd.session)


@pytest.mark.deep
def test_a_forked_server_imports_under_the_environment_it_was_asked_in(own_servers, tmp_path,
                                                                      monkeypatch):
    # Its own preloads see the environment and sys.path a server spawned now would: the
    # PYTHONPATH of the request, not its base's (started earlier, under another one).
    first, now = (os.pathsep.join([str(tmp_path / name), os.environ.get("PYTHONPATH", "")])
                  for name in ("first", "now"))
    monkeypatch.setenv("PYTHONPATH", first)
    run_isolated(code="pass", forkserver="spmd", timeout=120)
    monkeypatch.setenv("PYTHONPATH", now)
    # (a child inherits its server's record of the PYTHONPATH it started with)
    code = "from repro.harness import forkserver_process as p; print(p._SERVER_PYTHONPATH[0])"
    r = run_isolated(code=code, forkserver="torch", timeout=120)
    assert _parent(own_servers["torch"].session) == own_servers["spmd"].session
    assert r.ok and r.stdout == f"{tmp_path / 'now'}\n", r


@pytest.mark.parametrize("off", ["0", "false", "OFF", "no"])
def test_off_switch_spawns(monkeypatch, off):
    monkeypatch.setenv(forkserver.ENV, off)
    r = run_isolated(code="import sys; print('torch' in sys.modules)", forkserver=True)
    assert r.stdout == "False\n"


def test_a_switch_value_that_is_not_on_or_off_is_refused_naming_the_spellings(monkeypatch):
    monkeypatch.setenv(forkserver.ENV, "maybe")
    with pytest.raises(ValueError, match=r"^STACKFIX_FORKSERVER='maybe' is not an on/off value: "
                                         r"on is 1, true, yes or on; off is 0, false, no or off"):
        run_isolated(code="pass", forkserver=True)


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


@pytest.mark.deep
def test_omp_num_threads_sizes_torchs_pool_as_when_spawned():
    code = "import torch; print(torch.get_num_threads())"
    for env in ({"OMP_NUM_THREADS": "1"}, {}):
        forked, spawned = _both(code=code, env=env, timeout=120)
        assert forked.ok and forked.stdout == spawned.stdout, (env, forked, spawned)


# A process whose fork server imported torch under OMP_NUM_THREADS=2 (its own environment)
# runs a child per argv entry ("OMP_NUM_THREADS=1,MKL_NUM_THREADS=1"), forked and spawned:
# the child's OS threads before any torch op, then torch's pool size; one line each, the forked
# child's then the spawned one's.
_THREADS_UNDER_TWO = (
    "import sys\n"
    "from repro import run_isolated\n"
    "inner = (\"import os, torch; n = len(os.listdir('/proc/self/task')); \"\n"
    "         \"print(n, torch.get_num_threads())\")\n"
    "for spec in sys.argv[1:]:\n"
    "    env = dict(kv.split('=') for kv in spec.split(','))\n"
    "    for forked in (True, False):\n"
    "        r = run_isolated(code=inner, forkserver=forked, timeout=120, env=env)\n"
    "        print(r.stdout.strip() if r.ok else r.stderr[-2000:])\n")


def test_a_forked_child_sizes_torchs_pool_as_a_spawned_one():
    """Asking what the server was started with, the pool starts lazily: the child begins
    single-threaded (a caller's OMP_NUM_THREADS=2 for the whole run once had every forked
    child begin with two OS threads); asking less, or MKL_NUM_THREADS beside it (MKL's wins in
    torch), it gets a spawned child's count."""
    asks = ["OMP_NUM_THREADS=2", "OMP_NUM_THREADS=1", "OMP_NUM_THREADS=2,MKL_NUM_THREADS=1"]
    r = run_isolated(code=_THREADS_UNDER_TWO, args=asks, env={"OMP_NUM_THREADS": "2"},
                     timeout=300)
    assert r.ok, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    got = {ask: (lines[2 * i], lines[2 * i + 1]) for i, ask in enumerate(asks)}
    # (a spawned child's numpy may start OpenBLAS's pool at import: only its count compared)
    assert got["OMP_NUM_THREADS=2"][0] == "1 2", r.stdout
    for ask, (forked, spawned) in got.items():
        assert forked.split()[1] == spawned.split()[1], (ask, r.stdout)


@pytest.mark.parametrize("conf", ["roundup_power2_divisions:4", None])
def test_a_child_asking_another_cuda_allocator_config_is_spawned(monkeypatch, conf):
    """torch parses the CUDA caching allocator's configuration when it is imported (in the
    server): a child asking another one is spawned, one asking the server's is forked."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    env = {} if conf is None else {"PYTORCH_CUDA_ALLOC_CONF": conf}
    r = run_isolated(code="import sys; print('torch' in sys.modules)", forkserver=True,
                     env=env, timeout=120)
    assert r.stdout == ("False\n" if conf else "True\n"), r


def test_module_runs_as_main_with_its_argv(tmp_path):
    (tmp_path / "as_main.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    forked, spawned = _both(module="as_main", args=["x"], cwd=str(tmp_path), timeout=120)
    assert forked.stdout == spawned.stdout == "__main__ ['x']\n", (forked, spawned)


def _timed_out_after_writing(files, timeouts=(1.5, 3, 6, 12, 24, 48), **kw):
    """run_isolated(**kw) timing out only after the child wrote every one of ``files`` (pid
    files), however busy the machine: a run whose timeout fired first is tried again with twice
    the time. The bound comes from the work, not from a quiet machine's start-up time."""
    for timeout in timeouts:
        for f in files:
            f.unlink(missing_ok=True)
        r = run_isolated(timeout=timeout, **kw)
        if all(f.is_file() and f.stat().st_size for f in files):
            return r
    return r


@BOTH
def test_timeout_kills_the_child_and_what_it_started(forked, tmp_path):
    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    r = _timed_out_after_writing([pid_file], code=code, forkserver=forked)
    assert r.timed_out and r.returncode is None and time.monotonic() - start < 300
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed with the child's process group; reaped by init
        if not forkserver._running(grandchild):
            break
        time.sleep(0.1)
    assert not forkserver._running(grandchild)


@BOTH
def test_output_held_open_by_what_the_child_started_times_out(forked):
    # The child exits at once; the sleeper it started keeps its stdout open: subprocess's
    # communicate() times out on that, and so must the fork server's client.
    # The bound comes from the sleeper's 600 s, not from a quiet machine's start-up time.
    code = ("import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n")
    start = time.monotonic()
    r = run_isolated(code=code, timeout=1.5, forkserver=forked)
    assert r.timed_out and r.returncode is None and time.monotonic() - start < 300


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
    r = _timed_out_after_writing([tmp_path / str(rank) for rank in range(2)],
                                 code=RANKS.format(rank=rank), forkserver=forked)
    assert r.timed_out
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    for _ in range(50):
        if not any(forkserver._running(pid) for pid in pids):
            break
        time.sleep(0.1)
    assert not any(forkserver._running(pid) for pid in pids)


# --------------------------------------------------------------------------- inherited state

# A sitecustomize on the server's PYTHONPATH stands in for what a preload does at import time:
# register an atexit handler (megatron-core's wandb registers TemporaryDirectory cleanups), or
# hang, or start a thread (on a CUDA machine importing megatron.core starts a CUDA driver
# thread). It acts only in the server (STACKFIX_T_ROLE=server); children get role "child".
SITECUSTOMIZE = """
import atexit, importlib, os, threading, time
if os.environ.get("STACKFIX_T_ROLE") == "server" and os.environ.get("STACKFIX_T_THREAD_AFTER"):
    _import_module = importlib.import_module
    def _import_then_thread(name, package=None):
        module = _import_module(name, package)
        if name == os.environ["STACKFIX_T_THREAD_AFTER"]:
            threading.Thread(target=time.sleep, args=(600,), daemon=True, name="driver").start()
        return module
    importlib.import_module = _import_then_thread
if os.environ.get("STACKFIX_T_ROLE") == "server":
    marks = os.environ["STACKFIX_T_MARKS"]
    with open(os.path.join(marks, "server"), "w") as f:
        f.write(str(os.getpid()))
    atexit.register(lambda: open(os.path.join(marks, "atexit-%d" % os.getpid()), "w").close())
    if os.environ.get("STACKFIX_T_HANG") == "1":
        time.sleep(120)
"""


@pytest.fixture
def server_with_sitecustomize(monkeypatch, tmp_path):
    """This process's fork servers replaced by fresh ones that import SITECUSTOMIZE first; they
    are closed afterwards and the previous ones put back."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marks = tmp_path / "marks"
    marks.mkdir()
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.setenv("STACKFIX_T_ROLE", "server")
    monkeypatch.setenv("STACKFIX_T_MARKS", str(marks))
    monkeypatch.setattr(forkserver, "_servers", {})
    monkeypatch.setattr(forkserver, "_unavailable", {}, raising=False)
    yield marks
    for client in forkserver._servers.values():
        client.sock.close()
        if client.proc is not None:
            client.proc.wait(timeout=30)


@pytest.mark.deep
def test_a_forked_child_runs_its_own_atexit_handlers_not_the_servers(server_with_sitecustomize):
    marks = server_with_sitecustomize
    # As many handlers as a spawned interpreter that imported logging has (logging's flush),
    # less those its site start-up registered (a .pth file's or sitecustomize's, on some
    # images): the server's were registered for the server, and the child starts with none of
    # them. The one it registers runs.
    code = ("import atexit, logging\n"
            "print(atexit._ncallbacks())\n"
            "atexit.register(lambda: print('own handler'))\n")
    forked, spawned = _both(code=code, env={"STACKFIX_T_ROLE": "child"}, timeout=120)
    at_start = run_isolated(code="import atexit; print(atexit._ncallbacks())",
                            env={"STACKFIX_T_ROLE": "child"}, timeout=120)
    assert forked.ok and spawned.ok and at_start.ok, (forked.stderr[-3000:], spawned.stderr)
    assert (marks / "server").exists()  # the server did register its handler
    logging_only = int(spawned.stdout.split()[0]) - int(at_start.stdout)
    assert forked.stdout == f"{logging_only}\nown handler\n" == "1\nown handler\n", (
        forked.stdout, spawned.stdout, at_start.stdout)
    assert spawned.stdout.endswith("\nown handler\n"), spawned.stdout
    assert not [p.name for p in marks.iterdir() if p.name.startswith("atexit-")]


def test_a_hung_preload_is_killed_reported_and_children_are_spawned(
        server_with_sitecustomize, monkeypatch):
    marks = server_with_sitecustomize
    monkeypatch.setenv("STACKFIX_T_HANG", "1")
    monkeypatch.setattr(forkserver, "_READY_TIMEOUT", 3.0)
    child = {"STACKFIX_T_ROLE": "child", "STACKFIX_T_HANG": "0"}
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"fork server .*not ready after 3 s.*spawn"):
        r = run_isolated(code="import sys; print('torch' in sys.modules)", forkserver=True,
                         env=child, timeout=120)
    assert r.ok and r.stdout == "False\n", r  # spawned instead
    assert time.monotonic() - start < 60
    server = int((marks / "server").read_text())
    for _ in range(50):
        if not forkserver._running(server):
            break
        time.sleep(0.1)
    assert not forkserver._running(server)  # killed, not waited for
    start = time.monotonic()  # the next request does not wait for a server again
    r = run_isolated(code="print(1)", forkserver=True, env=child, timeout=120)
    assert r.stdout == "1\n" and time.monotonic() - start < 30


@pytest.mark.deep
@pytest.mark.parametrize("profile, module", [
    ("spmd", "spmd_types"),
    # megatron-core on a CUDA machine: the torch server is forked from the spmd one
    ("torch", "megatron.core.tensor_parallel"),
])
def test_a_preload_that_starts_a_thread_is_left_to_the_children(server_with_sitecustomize,
                                                                monkeypatch, profile, module):
    # As megatron.core on a CUDA machine: the server cannot fork after it, so it restarts with
    # the preloads before it, says so, and its children import that module themselves.
    pytest.importorskip(module.split(".")[0], reason=f"{module} is not installed")
    monkeypatch.setenv("STACKFIX_T_THREAD_AFTER", module)
    before = forkserver.PRELOADS[profile].index(module)
    code = (f"import os, sys; print('torch' in sys.modules, {module!r} in sys.modules, "
            f"len(os.listdir('/proc/self/task'))); import {module}; print('imported')")
    with pytest.warns(RuntimeWarning, match=rf"importing {re.escape(module)} left it unable to "
                      r"fork \(the fork server has \d+ threads, not 1: \S+, \S+.*\); it preloads "
                      rf"only the {before} modules before it"):
        r = run_isolated(code=code, forkserver=profile, env={"STACKFIX_T_ROLE": "child"},
                         timeout=120)
    assert r.ok and r.stdout == "True False 1\nimported\n", r
    assert profile not in forkserver._unavailable


def test_shared_types_live_in_a_leaf_module_the_fork_server_does_not_import_isolated():
    import ast
    import inspect

    from repro.harness import isolated

    def repro_imports(module) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return {n for n in names if n.startswith("repro")}

    from repro.harness import forkserver_request

    for module in (forkserver, forkserver_request):
        isolated_names = {n for n in repro_imports(module) if n == "repro.harness.isolated"
                          or n.startswith("repro.harness.isolated.")}
        assert not isolated_names, module
    leaf = inspect.getmodule(isolated.IsolatedResult)
    assert leaf is not isolated and not repro_imports(leaf), leaf
    assert forkserver_request.IsolatedResult is isolated.IsolatedResult


def test_a_process_ends_the_servers_it_started_before_it_exits():
    """A process that used fork servers closes them at its exit and waits for them: none is
    left running once it has exited, and no socket or ``Popen`` is left for the collector
    (``tox -e cpu`` printed "ResourceWarning: unclosed <socket.socket ...>" and "subprocess N
    is still running" as its workers exited, and the GPU runner found a server still running
    after every pytest step that used one, killing it as ``left_running``)."""
    import subprocess
    import sys

    code = ("from repro import run_isolated; from repro.harness import forkserver; "
            "r = run_isolated(code='print(1)', forkserver='torch', timeout=120); "
            "assert r.ok and r.stdout == '1\\n', r; "
            "print(*(c.session for c in forkserver._servers.values()))")
    done = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    sessions = [int(s) for s in done.stdout.split()]
    assert sessions  # the spmd server and the torch one forked from it
    assert [s for s in sessions if forkserver._running(s)] == []
    assert "ResourceWarning" not in done.stderr, done.stderr
