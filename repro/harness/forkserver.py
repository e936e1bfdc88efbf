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
  datasets; ``JE_ARROW_MALLOC_CONF=background_thread:false``). A preload that starts one
  anyway (on a CUDA machine, importing megatron.core leaves a CUDA driver thread, the
  interpreter's second) is found by the check after each preload: the server is restarted
  with the preloads before it, and a RuntimeWarning names the module and its threads; that
  profile's children import it (and what follows it) themselves;
* never runs a torch op and never initialises CUDA (it only imports; checked before every
  fork: ``torch.cuda.is_initialized()`` is False). torch's thread pools start lazily in each
  child, sized by the child's own ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
  (``forkserver_process._set_torch_threads``: OpenMP read them when the server imported torch).

How a child differs from ``python -c`` / ``python -m`` (none of it matters to a repro):

* the preloaded modules were imported once, under the server's environment: variables they
  read at import time take the server's values (the child's ``os.environ``, ``sys.argv``,
  ``sys.path`` (its ``PYTHONPATH``), working directory, stdio and faulthandler are the
  request's); numpy's BLAS keeps one thread and pyarrow's jemalloc no background thread; every
  child shares the server's hash seed (``random`` reseeds itself at fork);
* a child that must import a preloaded package from elsewhere (a Megatron-LM checkout instead
  of the installed megatron-core), or must not find one imported (tests of what happens
  without torchtitan), cannot use the server (or that profile): its caller spawns it;
* it starts with none of the server's atexit handlers (the preloads registered them for the
  server's state; logging's flush is registered afresh) and ends with the Python-level part of
  interpreter shutdown (non-daemon threads joined, the atexit handlers it registered run,
  output flushed) and ``os._exit``: the C-level teardown of the preloaded modules is skipped,
  so a crash that only module teardown would cause is not seen.

Why not the standard library's (``multiprocessing`` with ``set_start_method("forkserver")``
and ``set_forkserver_preload``): it also forks from one preloaded, single-threaded process,
but what it starts is a ``Process`` running a picklable function, not an interpreter run.
A crash child here needs, per request, what that does not give:

* its own process group, so a timeout kills the child and everything it started (a repro's
  rank processes); multiprocessing's children stay in the server's group, and its ranks would
  not be forked by the same server;
* its own stdout and stderr, captured (the tests match the fault handler's dump and the
  traceback text); multiprocessing's children write to the server's stdio;
* ``python -c`` / ``python -m`` semantics: the request's environment, working directory,
  ``sys.argv``, ``sys.path`` and ``__main__``; multiprocessing's children keep the server's
  environment and working directory;
* the exit status a shell sees (negative for a signal) and the child's own atexit handlers
  run; multiprocessing's children end with ``os._exit`` after the target returns.

Adding those to multiprocessing's server would replace most of it; hence this one.

Protocol. The client owns one end of a ``SOCK_SEQPACKET`` socket pair, the server the other;
the server exits when the client's end closes (the client process ended). A request is one
JSON message carrying three descriptors (SCM_RIGHTS): a status socket and the write ends of
the child's stdout and stderr pipes. Per request the server forks a supervisor, which forks
the child, sends ``{"pid"}`` then ``{"returncode"}`` (negative for a signal) on the status
socket, and exits. The client reads the pipes as ``subprocess`` does; on a timeout it kills
the child's process group. Each child gets a connection of its own to the server, so what it
starts (a repro's ranks) is forked there too; every process the server forks lives in the
server's session, so a rank can join its requester's process group and die with it. The
server's side (its loop, the supervisor, the child's set-up) is in
repro.harness.forkserver_process. A server that is not ready within ``_READY_TIMEOUT`` (a
preload that hangs) is killed with its process group; a RuntimeWarning says why and that
profile's children are spawned from then on. Linux only (``/proc``); ``STACKFIX_FORKSERVER=0``
turns it off (everything is spawned).
"""

from __future__ import annotations

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
import warnings
from collections.abc import Mapping, Sequence

from repro.harness.isolated_result import IsolatedResult

ENV = "STACKFIX_FORKSERVER"
# What a server imports once, by profile: what its children spend their start-up on.
_SPMD = (
    "torch",
    "torch.utils.checkpoint",
    "torch._dynamo",  # imported by the first checkpoint otherwise (~1 s)
    "spmd_types",
    "repro.registry",  # not repro.child: runpy warns when the module it runs is imported
    "repro.harness.sanitize",
)
_TORCH = (*_SPMD, "megatron.core.tensor_parallel")
PRELOADS = {
    "torch": _TORCH,
    # Children that need no megatron-core (the mesh repros): a server ready ~1 s sooner, which
    # is most of `python -m repro --only mesh-recompute`'s wait.
    "spmd": _SPMD,
    # Only for children that import torchtitan themselves: fixes.torchtitan's mesh snapshot,
    # the mesh sanitizer and others look torchtitan up in sys.modules.
    "torchtitan": (*_TORCH, "torchtitan.trainer", "fixes.torchtitan.engine"),
}
# The environment a server imports under, so that no thread is left running after the
# imports: numpy's OpenBLAS pool (1 = none), pyarrow's jemalloc background thread
# (torchtitan imports datasets). Its children get the request's environment.
_SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
MAX_MESSAGE = 1 << 20
_READY_TIMEOUT = 300.0


def enabled() -> bool:
    """Whether ``run`` may be used here: Linux (fork, SCM_RIGHTS, /proc) and not turned off."""
    return (os.environ.get(ENV, "1") != "0" and sys.platform.startswith("linux")
            and hasattr(os, "fork") and hasattr(socket, "send_fds"))


# ---- client -------------------------------------------------------------------------------


class _Client:
    """A connection to a fork server: the one this process started, or, in a forked child,
    the one its server gave it (so that what a child starts is forked by the same server)."""

    def __init__(self, sock: socket.socket, session: int, proc: subprocess.Popen | None,
                 preloads: tuple[str, ...] = ()):
        self.sock, self.session, self.proc, self.pid = sock, session, proc, os.getpid()
        self.preloads = preloads  # what the server imported (its children have them)

    @classmethod
    def start(cls, profile: str, upto: int | None = None) -> _Client:
        """A server with the profile's first ``upto`` preloads (all: None); ``UnsafePreload``
        when one of them leaves it unable to fork, OSError when it does not start."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, **_SERVER_ENV)
        code = (f"from repro.harness.forkserver_process import serve; "
                f"serve({theirs.fileno()}, {profile!r}, {upto!r})")
        proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its session (id: its pid) holds every child it forks
        )
        theirs.close()
        mine.settimeout(_READY_TIMEOUT)
        try:
            ready = mine.recv(MAX_MESSAGE)
        except TimeoutError:
            ready = None
        except OSError:
            ready = b""
        mine.settimeout(None)
        if ready != b"ready":
            mine.close()
            # Its session (and process group) has its pid: a preload that hangs, or started
            # something, is ended with it. Never wait for a server that is still running.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if ready and ready.startswith(b"{"):
                raise UnsafePreload(profile, json.loads(ready))
            if ready is None:
                why = f"not ready after {_READY_TIMEOUT:g} s (its imports hung?); killed it"
            else:
                why = f"did not start: {ready.decode(errors='replace') or 'exited'!r}"
            raise OSError(f"fork server (profile {profile!r}) {why}")
        return cls(mine, proc.pid, proc, PRELOADS[profile][:upto])

    def usable(self) -> bool:
        return self.pid == os.getpid() and (self.proc is None or self.proc.poll() is None)


class UnsafePreload(OSError):
    """A preload left the server unable to fork (a thread it started, CUDA initialised): the
    server's report, with the index of that preload in its profile."""

    def __init__(self, profile: str, report: dict):
        self.index, self.module = report["unsafe_after"], report["module"]
        super().__init__(f"fork server (profile {profile!r}): importing {self.module} left it "
                         f"unable to fork ({report['why']}: {', '.join(report['threads'])})")


def _start(profile: str) -> _Client:
    """A server for ``profile``; where one of its preloads leaves it unable to fork (on a CUDA
    machine ``megatron.core`` starts a CUDA driver thread at import), one with the preloads
    before it, with a RuntimeWarning naming the module: its children import that module and
    the rest themselves. OSError when neither starts."""
    try:
        return _Client.start(profile)
    except UnsafePreload as exc:
        if exc.index == 0:
            raise
        warnings.warn(f"{exc}; it preloads only the {exc.index} modules before it, and its "
                      "children import the rest themselves", RuntimeWarning, stacklevel=4)
        return _Client.start(profile, upto=exc.index)


_servers: dict[str, _Client] = {}  # the servers this process started, by profile
_unavailable: dict[str, str] = {}  # profiles whose server failed to start here, and why
_attached: _Client | None = None  # in a forked child: the server that forked it
_locks = {profile: threading.Lock() for profile in PRELOADS}  # one server starts per profile


def prestart(profiles) -> None:
    """Start the servers of ``profiles`` in the background (each on its own thread), so that
    their imports overlap with the caller's; a later ``run`` waits for them if need be. Does
    nothing where fork servers are not ``enabled()``."""
    if not enabled():
        return
    for profile in dict.fromkeys(profiles):
        if profile not in PRELOADS:
            raise ValueError(f"unknown fork server profile {profile!r}; known: {sorted(PRELOADS)}")
        threading.Thread(target=_connected, args=(profile,), daemon=True,
                         name=f"forkserver-prestart-{profile}").start()


def attach(conn: socket.socket) -> None:
    """In a child the server has just forked: ``conn`` is the child's own connection to it."""
    global _attached
    _attached = _Client(conn, os.getsid(0), proc=None)


def attached() -> bool:
    """Whether this process is a child forked by a fork server (and so can have its own
    children forked cheaply, by the same server)."""
    return _attached is not None and _attached.usable()


def _connected(profile: str) -> _Client | None:
    """In a forked child, its own server (whatever ``profile``: the child has its preloads);
    else this process's server for ``profile``, started on first use (a forked copy of a
    process that had one starts its own), or None if it cannot start: then a RuntimeWarning
    says why, once, and later calls return None at once (the caller spawns)."""
    if profile not in PRELOADS:
        raise ValueError(f"unknown fork server profile {profile!r}; known: {sorted(PRELOADS)}")
    if attached():
        return _attached
    with _locks[profile]:
        client = _servers.get(profile)
        if client is not None and client.usable():
            return client
        if profile in _unavailable:
            return None
        try:
            _servers[profile] = client = _start(profile)
        except OSError as exc:
            _servers.pop(profile, None)
            _unavailable[profile] = str(exc)
            warnings.warn(f"{exc}; children are spawned instead", RuntimeWarning, stacklevel=3)
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

    def result(self) -> IsolatedResult:
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


def collect(children: Sequence[Forked], timeout: float | None) -> list[IsolatedResult]:
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
) -> IsolatedResult | None:
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
