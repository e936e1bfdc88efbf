"""A fork server for crash children: one process that has imported torch (and spmd_types,
megatron-core where installed; torchtitan too in the "torchtitan" profile) once, and forks a
fresh child per request, so a child starts in milliseconds instead of paying 1.5-5 s of imports.
``run_isolated(..., forkserver=True)`` and ``run_loopback_ranks(..., forkserver=True)`` use it. A
child is still its own process leading its own process group, so a SIGSEGV, an abort or a hang
ends that child (and what it started) only, exactly as with a spawned interpreter.

Why fork is safe here. A fork copies only the calling thread; locks other threads held stay
locked in the child, and a CUDA context or an OpenMP / torch intra-op thread pool does not
survive a fork. The server therefore

* is single-threaded, checked before every fork (``/proc/self/task``). Two imports would start
  a thread; the server imports under ``_SERVER_ENV``, which stops both: numpy's OpenBLAS pool
  (``OPENBLAS_NUM_THREADS=1``) and pyarrow's jemalloc background thread (torchtitan imports
  datasets; ``JE_ARROW_MALLOC_CONF=background_thread:false``);
* never runs a torch op and never initialises CUDA (it only imports; checked before every
  fork: ``torch.cuda.is_initialized()`` is False). torch's thread pools start lazily in each
  child, sized by the child's own ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
  (``_set_torch_threads``: OpenMP itself read them when the server imported torch).

How a child differs from ``python -c`` / ``python -m`` (none of it matters to a repro):

* the preloaded modules were imported once, under the server's environment: variables they
  read at import time take the server's values (the child's ``os.environ``, ``sys.argv``,
  ``sys.path`` (its ``PYTHONPATH``), working directory, stdio and faulthandler are the
  request's); numpy's BLAS keeps one thread and pyarrow's jemalloc no background thread; every
  child shares the server's hash seed (``random`` reseeds itself at fork);
* a child that must import a preloaded package from elsewhere (a Megatron-LM checkout instead
  of the installed megatron-core), or must not find one imported (tests of what happens
  without torchtitan), cannot use the server (or that profile): its caller spawns it;
* it ends with the Python-level part of interpreter shutdown (non-daemon threads joined,
  atexit handlers run, output flushed) and ``os._exit``: the C-level teardown of the preloaded
  modules (~1.4 s) is skipped, so a crash that only module teardown would cause is not seen.

Protocol. The client owns one end of a ``SOCK_SEQPACKET`` socket pair, the server the other;
the server exits when the client's end closes (the client process ended). A request is one
JSON message carrying three descriptors (SCM_RIGHTS): a status socket and the write ends of
the child's stdout and stderr pipes. Per request the server forks a supervisor, which forks
the child, sends ``{"pid"}`` then ``{"returncode"}`` (negative for a signal) on the status
socket, and exits. The client reads the pipes as ``subprocess`` does; on a timeout it kills
the child's process group. Each child gets a connection of its own to the server, so what it
starts (a repro's ranks) is forked there too; every process the server forks lives in the
server's session, so a rank can join its requester's process group and die with it. Linux
only (``/proc``); ``STACKFIX_FORKSERVER=0`` turns it off (everything is spawned).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence

ENV = "STACKFIX_FORKSERVER"
# What a server imports once, by profile: what its children spend their start-up on.
_TORCH = (
    "torch",
    "torch.utils.checkpoint",
    "torch._dynamo",  # imported by the first checkpoint otherwise (~1 s)
    "spmd_types",
    "megatron.core.tensor_parallel",
    "repro.registry",  # not repro.child: runpy warns when the module it runs is imported
    "repro.harness.sanitize",
)
PRELOADS = {
    "torch": _TORCH,
    # Only for children that import torchtitan themselves: fixes.torchtitan's mesh snapshot,
    # the mesh sanitizer and others look torchtitan up in sys.modules.
    "torchtitan": (*_TORCH, "torchtitan.trainer", "fixes.torchtitan.engine"),
}
# The environment a server imports under, so that no thread is left running after the
# imports: numpy's OpenBLAS pool (1 = none), pyarrow's jemalloc background thread
# (torchtitan imports datasets). Its children get the request's environment.
_SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
_MAX_MESSAGE = 1 << 20
_READY_TIMEOUT = 300.0


def enabled() -> bool:
    """Whether ``run`` may be used here: Linux (fork, SCM_RIGHTS, /proc) and not turned off."""
    return (os.environ.get(ENV, "1") != "0" and sys.platform.startswith("linux")
            and hasattr(os, "fork") and hasattr(socket, "send_fds"))


# ---- client -------------------------------------------------------------------------------


class _Client:
    """A connection to a fork server: the one this process started, or, in a forked child,
    the one its server gave it (so that what a child starts is forked by the same server)."""

    def __init__(self, sock: socket.socket, session: int, proc: subprocess.Popen | None):
        self.sock, self.session, self.proc, self.pid = sock, session, proc, os.getpid()

    @classmethod
    def start(cls, profile: str) -> _Client:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, **_SERVER_ENV)
        code = f"from repro.harness.forkserver import serve; serve({theirs.fileno()}, {profile!r})"
        proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its session (id: its pid) holds every child it forks
        )
        theirs.close()
        mine.settimeout(_READY_TIMEOUT)
        try:
            ready = mine.recv(_MAX_MESSAGE)
        except OSError:
            ready = b""
        mine.settimeout(None)
        if ready != b"ready":
            mine.close()
            proc.wait()
            raise OSError(f"fork server did not start: {ready.decode(errors='replace')!r}")
        return cls(mine, proc.pid, proc)

    def usable(self) -> bool:
        return self.pid == os.getpid() and (self.proc is None or self.proc.poll() is None)


_servers: dict[str, _Client] = {}  # the servers this process started, by profile
_attached: _Client | None = None  # in a forked child: the server that forked it
_lock = threading.Lock()


def attached() -> bool:
    """Whether this process is a child forked by a fork server (and so can have its own
    children forked cheaply, by the same server)."""
    return _attached is not None and _attached.usable()


def _connected(profile: str) -> _Client | None:
    """In a forked child, its own server (whatever ``profile``: the child has its preloads);
    else this process's server for ``profile``, started on first use (a forked copy of a
    process that had one starts its own), or None if it cannot start."""
    if profile not in PRELOADS:
        raise ValueError(f"unknown fork server profile {profile!r}; known: {sorted(PRELOADS)}")
    if attached():
        return _attached
    with _lock:
        client = _servers.get(profile)
        if client is not None and client.usable():
            return client
        try:
            _servers[profile] = client = _Client.start(profile)
        except OSError:
            _servers.pop(profile, None)
            return None
        return client


class Forked:
    """A child the server forked, being read (``collect``)."""

    def __init__(self, status: socket.socket, out_r: int, err_r: int, own_group: bool):
        self.status, self.out_r, self.err_r, self.own_group = status, out_r, err_r, own_group
        self.start = time.monotonic()
        self.chunks: dict[int, list[bytes]] = {out_r: [], err_r: [], status.fileno(): []}
        self.reports: dict = {}
        self.timed_out = False

    def kill(self) -> None:
        """SIGKILL the child (with its process group when it leads one)."""
        if "pid" not in self.reports:  # sent right after the fork: wait for it
            self.status.settimeout(10)
            try:
                self._got(self.status.fileno(), self.status.recv(4096))
            except OSError:
                pass  # no supervisor: nothing to kill
            finally:
                self.status.settimeout(None)
        try:
            if self.own_group:
                os.killpg(self.reports["pid"], signal.SIGKILL)
            else:
                os.kill(self.reports["pid"], signal.SIGKILL)
        except (KeyError, ProcessLookupError):
            pass

    def _got(self, fd: int, data: bytes) -> None:
        self.chunks[fd].append(data)
        if fd == self.status.fileno():
            self.reports = _parse_reports(b"".join(self.chunks[fd]))

    def result(self):
        from repro.harness.isolated import IsolatedResult

        self.status.close()
        out, err = (b"".join(self.chunks[fd]) for fd in (self.out_r, self.err_r))
        if "returncode" not in self.reports:
            raise RuntimeError(f"fork server: no exit status for the child ({self.reports}); "
                               "stderr:\n" + _decode(err)[-2000:])
        return IsolatedResult(
            returncode=None if self.timed_out else self.reports["returncode"],
            stdout=_decode(out), stderr=_decode(err),
            seconds=time.monotonic() - self.start, timed_out=self.timed_out,
        )


def start(
    kind: str, target: str, args: Sequence[str], env: Mapping[str, str], cwd: str | None,
    own_group: bool = True, profile: str = "torch",
) -> Forked | None:
    """Have the server fork ``python -c target`` (kind "code") or ``python -m target`` (kind
    "module") with ``args``, environment ``env`` (the whole of it) and ``cwd``; read it with
    ``collect``. ``own_group``: the child leads a new process group (``start_new_session``);
    otherwise it joins this process's group where it can (a child's ranks, killed with it).
    ``profile``: the server's preloads (PRELOADS).

    None when the server cannot take the request (it could not start or has gone): the caller
    then spawns the child itself.
    """
    client = _connected(profile)
    if client is None:
        return None
    join = not own_group and os.getsid(0) == client.session
    request = {"kind": kind, "target": target, "args": list(args), "env": dict(env),
               "cwd": os.path.abspath(cwd) if cwd is not None else os.getcwd(),
               "group": os.getpgrp() if join else None}
    status, status_theirs = socket.socketpair()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        socket.send_fds(client.sock, [json.dumps(request).encode()],
                        [status_theirs.fileno(), out_w, err_w])
    except OSError:
        for fd in (out_r, err_r):
            os.close(fd)
        status.close()
        return None
    finally:
        status_theirs.close()
        os.close(out_w)
        os.close(err_w)
    return Forked(status, out_r, err_r, own_group=not join)


def collect(children: Sequence[Forked], timeout: float | None) -> list:
    """Read every child's stdout, stderr and exit status until all have ended; those not
    done ``timeout`` seconds after the first started (still running, or their output still
    open in what they started) are killed (``timed_out``), as ``subprocess`` callers here do.
    Returns their IsolatedResults, in order."""
    deadline = None if timeout is None else min(c.start for c in children) + timeout
    with selectors.DefaultSelector() as sel:
        for child in children:
            for fd in child.chunks:
                sel.register(fd, selectors.EVENT_READ, data=child)
        while sel.get_map():
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = sel.select(wait)
            if not ready and deadline is not None:
                deadline = None
                for child in {key.data for key in sel.get_map().values()}:
                    child.timed_out = True
                    child.kill()
                continue
            for key, _ in ready:
                data = os.read(key.fd, 65536)
                if data:
                    key.data._got(key.fd, data)
                    continue
                sel.unregister(key.fd)
                if key.fd != key.data.status.fileno():
                    os.close(key.fd)
    return [child.result() for child in children]


def run(
    kind: str, target: str, args: Sequence[str], env: Mapping[str, str], cwd: str | None,
    timeout: float, profile: str = "torch",
):
    """One child (``start``) read to its end (``collect``); None when the server cannot take
    it. It leads its own process group: a timeout kills it and what it started."""
    child = start(kind, target, args, env, cwd, profile=profile)
    return None if child is None else collect([child], timeout)[0]


def _parse_reports(data: bytes) -> dict:
    out: dict = {}
    for line in data.decode().splitlines():
        if line.strip():
            out.update(json.loads(line))
    return out


def _decode(data: bytes) -> str:
    """As ``subprocess.Popen(text=True)`` decodes a child's output."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ---- server -------------------------------------------------------------------------------


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload(profile: str) -> None:
    for name in PRELOADS[profile]:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue  # optional and not installed: the children that need it skip
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # a child importing it sees the same error itself


def _unsafe_to_fork() -> str | None:
    if (n := _os_threads()) != 1:
        return f"the fork server has {n} threads, not 1"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the fork server"
    return None


def serve(fd: int, profile: str) -> None:
    """The server's main loop (``fd``: its end of the client's socket pair). Each child gets a
    connection of its own to this loop; the server exits when the client's closes."""
    root = socket.socket(fileno=fd)
    _preload(profile)
    if (why := _unsafe_to_fork()) is not None:
        root.send(why.encode())
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    root.send(b"ready")
    with selectors.DefaultSelector() as sel:
        sel.register(root, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                conn = key.fileobj
                message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
                if message:
                    _fork_request(json.loads(message), fds, sel)
                elif conn is root:
                    return  # the client has gone
                else:
                    sel.unregister(conn)  # a child has ended
                    conn.close()


def _fork_request(request: dict, fds: list[int], sel: selectors.BaseSelector) -> None:
    status = socket.socket(fileno=fds[0])
    if (why := _unsafe_to_fork()) is not None:
        status.sendall(json.dumps({"error": why}).encode() + b"\n")
    else:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.fork() == 0:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()
            mine.close()
            _supervise(request, status, fds[1], fds[2], theirs)  # never returns
        theirs.close()
        sel.register(mine, selectors.EVENT_READ)
    status.close()
    os.close(fds[1])
    os.close(fds[2])


def _supervise(request: dict, status: socket.socket, out_w: int, err_w: int,
               conn: socket.socket) -> None:
    """Fork the child, report its pid and then its exit status, and exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid needs its child kept for it
    pid = os.fork()
    if pid == 0:
        status.close()
        _child(request, out_w, err_w, conn)
    conn.close()
    if request["group"] is None:
        try:  # as the child does: its group exists before the client can signal it
            os.setpgid(pid, pid)
        except OSError:
            pass  # it has already ended
    try:
        status.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, wait_status = os.waitpid(pid, 0)
        status.sendall(json.dumps(
            {"returncode": os.waitstatus_to_exitcode(wait_status)}).encode() + b"\n")
    finally:
        os._exit(0)


def _child(request: dict, out_w: int, err_w: int, conn: socket.socket) -> None:
    """Become the requested interpreter, run it, and exit as ``python -c`` / ``-m`` would."""
    global _attached
    # A group of its own (a timeout kills what it starts, too) or its requester's (a rank).
    os.setpgid(0, request["group"] or 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _attached = _Client(conn, os.getsid(0), proc=None)  # what it starts is forked here too
    env = request["env"]
    _redirect_stdio(out_w, err_w, unbuffered=env.get("PYTHONUNBUFFERED", "") != "")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    _set_sys_path(request["kind"], env.get("PYTHONPATH", ""))
    _set_torch_threads(env)
    import faulthandler

    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER", ""):
        faulthandler.enable()
    try:
        if request["kind"] == "module":
            import runpy

            sys.argv = [request["target"], *request["args"]]  # runpy sets [0] to the file
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *request["args"]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(request["target"], "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter reports it
        # from the target's frames on: this function's own frame is no part of the child's run
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        code = 1
    _shut_down(code)


def _set_torch_threads(env: Mapping[str, str]) -> None:
    """torch's intra-op pool size as a spawned child would have it. OpenMP read the server's
    environment when torch was imported; the child's ``OMP_NUM_THREADS`` (e.g. 1 for a rank)
    must still apply, or ranks side by side would each spin a pool of every core."""
    torch = sys.modules.get("torch")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch's own order
        value = env.get(name, "")
        if torch is not None and value.isdigit() and int(value) > 0:
            torch.set_num_threads(int(value))
            return


def _exit_code(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives (a non-int is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _shut_down(code: int) -> None:
    """The Python-level steps of interpreter shutdown, then ``os._exit``: non-daemon threads
    joined, atexit handlers run, stdio flushed. The C-level teardown (a full collection and
    module teardown over every preloaded object, ~1.4 s) is skipped: a child's outcome is
    decided before it."""
    threading._shutdown()  # what Py_FinalizeEx calls first: wait for non-daemon threads
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _redirect_stdio(out_w: int, err_w: int, unbuffered: bool) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((null, 0), (out_w, 1), (err_w, 2)):
        os.dup2(src, dst)
        os.close(src)

    def text(fd: int, like: io.TextIOWrapper, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding=like.encoding, errors=like.errors,
                                line_buffering=line_buffering, write_through=unbuffered)

    # As the interpreter sets them up for pipes: stdout block-buffered, stderr line-buffered.
    sys.stdout = sys.__stdout__ = text(1, sys.__stdout__, line_buffering=False)
    sys.stderr = sys.__stderr__ = text(2, sys.__stderr__, line_buffering=True)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)


# sys.path as the server started with it: [path0, *PYTHONPATH entries, *the rest].
_SERVER_PYTHONPATH = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(
    os.pathsep) if p]


def _set_sys_path(kind: str, pythonpath: str) -> None:
    """``sys.path`` as the interpreter would build it for this request: the working directory
    ("" for -c, its absolute path for -m), the request's PYTHONPATH, then the installation's."""
    rest = sys.path[1 + len(_SERVER_PYTHONPATH):]
    entries = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    sys.path[:] = ["" if kind == "code" else os.getcwd(), *entries, *rest]
    importlib.invalidate_caches()
