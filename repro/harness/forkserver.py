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
  fork: ``torch.cuda.is_initialized()`` is False). torch's thread pools are sized by the
  child's own ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``: OpenMP and MKL read the server's when
  it imported torch, so a child asking the same starts its pool lazily, as a spawned child,
  and one asking another count has it set as it starts (its pool running from then on; not
  capped to the physical cores as a spawned child's: ``forkserver_process._set_torch_threads``).

How a child differs from ``python -c`` / ``python -m`` (none of it matters to a repro):

* the preloaded modules were imported once, under the server's environment: variables they
  read at import time take the server's values (the child's ``os.environ``, ``sys.argv``,
  ``sys.path`` (its ``PYTHONPATH``), working directory, stdio and faulthandler are the
  request's) -- but a child asking another CUDA allocator configuration than the server's
  import read (``READ_AT_IMPORT``: it would change the bytes a peak counts) is spawned; numpy's
  BLAS keeps one thread and pyarrow's jemalloc no background thread; every child shares the
  server's hash seed (``random`` reseeds itself at fork);
* a child that must import a preloaded package from elsewhere (a Megatron-LM checkout instead
  of the installed megatron-core), or must not find one imported (tests of what happens
  without torchtitan), cannot use the server (or that profile): its caller spawns it;
* it starts with none of the server's atexit handlers (the preloads, and on some images site
  start-up through a ``.pth`` file or sitecustomize, registered them for the server's state;
  logging's flush is registered afresh) and ends with the Python-level part of interpreter
  shutdown (non-daemon threads joined, the atexit handlers it registered run, output flushed)
  and ``os._exit``: the C-level teardown of the preloaded modules is skipped, so a crash that
  only module teardown would cause is not seen.

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

Servers by profile. A profile whose preloads extend another's (``_BASE``: torch extends spmd
with megatron-core, torchtitan extends torch) has its server forked from that one's, started
first if need be. The forked server takes the request's environment and ``sys.path``, imports
only what its profile adds and leads a session of its own; it is ready as soon as one spawned
afresh would be (the imports run one after the other either way), and a process that uses
all three profiles pays the shared imports once instead of three times. Its base's preloads
were imported under the base's environment, as every child's are.

Protocol. The client owns one end of a ``SOCK_SEQPACKET`` socket pair, the server the other;
the server sends its pid, then "ready" once its imports are done, and exits when the client's
end closes (the client process ended). A request is one JSON message carrying three
descriptors (SCM_RIGHTS): a status socket and the write ends of the child's stdout and stderr
pipes. Per request the server forks a supervisor, which forks
the child, sends ``{"pid"}`` then ``{"returncode"}`` (negative for a signal) on the status
socket, and exits; a request of kind "server" carries one descriptor, the new server's end of
its own socket pair. The client (repro.harness.forkserver_request) reads the pipes as ``subprocess`` does; on a timeout it kills
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

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping

from fixes.switch import env_switch
from repro.harness.checkout import with_checkout

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
    # The children of the verl envs' tests (tests/test_verl_plugin.py, test_verl_engine.py):
    # what ``import verl`` spends its ~4.5 s on (tensordict, transformers, omegaconf, hydra).
    # Never verl, megatron-core or torchtitan: the plugin (fixes.verl) is loaded by ``import
    # verl`` and patches megatron's and verl's modules as they are imported, in the child.
    "verl": (*_SPMD, "tensordict", "transformers", "omegaconf", "hydra"),
}
# A profile's server is forked from the server of the profile its preloads extend (the longest
# proper prefix: torch from spmd, torchtitan from torch) and imports only the rest: as soon
# ready as one started afresh (the imports are sequential either way), and the shared imports'
# CPU and memory are paid once per process instead of once per profile.
_BASE = {
    profile: max((other for other, pre in PRELOADS.items()
                  if len(pre) < len(mine) and mine[:len(pre)] == pre),
                 key=lambda other: len(PRELOADS[other]), default=None)
    for profile, mine in PRELOADS.items()
}
# The environment a server imports under, so that no thread is left running after the
# imports: numpy's OpenBLAS pool (1 = none), pyarrow's jemalloc background thread
# (torchtitan imports datasets). Its children get the request's environment.
_SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
MAX_MESSAGE = 1 << 20
_READY_TIMEOUT = 300.0
_CLOSE_TIMEOUT = 10.0  # a server's own shutdown at its client's exit (``_close_servers``)


def enabled() -> bool:
    """Whether ``run`` may be used here: Linux (fork, SCM_RIGHTS, /proc) and not turned off
    (``STACKFIX_FORKSERVER``: on unless an off value; ValueError naming the spellings for a
    value that is neither)."""
    return (env_switch(ENV, True) and sys.platform.startswith("linux")
            and hasattr(os, "fork") and hasattr(socket, "send_fds"))


# ---- client -------------------------------------------------------------------------------


# What torch reads once, when a server imports it, that a child's own environment cannot
# change afterwards: the CUDA caching allocator's configuration (parsed as libc10_cuda loads;
# ``roundup_power2_divisions`` changes the bytes a child's peak counts). A child asking other
# values than its server's import had is spawned (``forkserver_request.start``).
READ_AT_IMPORT = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def read_at_import(env: Mapping[str, str]) -> dict[str, str | None]:
    return {name: env.get(name) for name in READ_AT_IMPORT}


class _Client:
    """A connection to a fork server: one this process started (spawned, ``proc``, or forked
    from another of its servers), or, in a forked child, the one its server gave it (so that
    what a child starts is forked by the same server)."""

    def __init__(self, sock: socket.socket, session: int, proc: subprocess.Popen | None,
                 imported: dict[str, str | None], preloads: tuple[str, ...] = ()):
        self.sock, self.session, self.proc, self.pid = sock, session, proc, os.getpid()
        # ``read_at_import`` of the environment the server imported torch under (a forked
        # server's: its base's)
        self.imported = imported
        self.preloads = preloads  # what the server imported (its children have them)

    @classmethod
    def start(cls, profile: str, upto: int | None = None, base: _Client | None = None) -> _Client:
        """A server with the profile's first ``upto`` preloads (all: None), spawned, or forked
        from ``base`` (a server whose preloads are a prefix of those); ``UnsafePreload`` when
        one of them leaves it unable to fork, OSError when it does not start."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = with_checkout(dict(os.environ, **_SERVER_ENV))
        proc = None
        try:
            if base is None:
                code = (f"from repro.harness.forkserver_process import serve; "
                        f"serve({theirs.fileno()}, {profile!r}, {upto!r})")
                proc = subprocess.Popen(
                    [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # its session (id: its pid) holds what it forks
                )
            else:
                request = {"kind": "server", "profile": profile, "upto": upto, "env": env}
                socket.send_fds(base.sock, [json.dumps(request).encode()], [theirs.fileno()])
        finally:
            theirs.close()
        deadline = time.monotonic() + _READY_TIMEOUT
        hello = _recv_until(mine, deadline)  # the server's pid, sent before its imports
        pid = proc.pid if proc is not None else None
        if hello and hello.startswith(b"{"):
            pid = json.loads(hello)["pid"]
            ready = _recv_until(mine, deadline)
        else:
            ready = hello
        if ready != b"ready":
            mine.close()
            # Its session (and process group) has its pid: a preload that hangs, or started
            # something, is ended with it. Never wait for a server that is still running.
            _kill_session(pid, proc)
            if ready and ready.startswith(b"{"):
                raise UnsafePreload(profile, json.loads(ready))
            if ready is None:
                why = f"not ready after {_READY_TIMEOUT:g} s (its imports hung?); killed it"
            else:
                why = f"did not start: {ready.decode(errors='replace') or 'exited'!r}"
            raise OSError(f"fork server (profile {profile!r}) {why}")
        return cls(mine, pid, proc, read_at_import(env) if base is None else base.imported,
                   PRELOADS[profile][:upto])

    def usable(self) -> bool:
        if self.pid != os.getpid():
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        # Not this process's child: a server sends nothing after "ready", so a readable
        # connection is its end (it has exited).
        readable, _, _ = select.select([self.sock], [], [], 0)
        return not readable

    def close(self, timeout: float = 30.0) -> None:
        """Close the connection, which ends the server, and wait (up to ``timeout``) until it
        has exited."""
        self.sock.close()
        if self.proc is not None:
            self.proc.wait(timeout=timeout)
            return
        deadline = time.monotonic() + timeout
        while _running(self.session) and time.monotonic() < deadline:
            time.sleep(0.01)


def _kill_session(session: int | None, proc: subprocess.Popen | None) -> None:
    """A server ended with its session (its pid: what it started too), and reaped where it is
    this process's child."""
    if session is not None:
        try:
            os.killpg(session, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc is not None:
        proc.wait()


def _recv_until(sock: socket.socket, deadline: float) -> bytes | None:
    """One message; None at the deadline, b"" when the peer has gone."""
    sock.settimeout(max(0.0, deadline - time.monotonic()))
    try:
        return sock.recv(MAX_MESSAGE)
    except TimeoutError:
        return None
    except OSError:
        return b""
    finally:
        sock.settimeout(None)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class UnsafePreload(OSError):
    """A preload left the server unable to fork (a thread it started, CUDA initialised): the
    server's report, with the index of that preload in its profile."""

    def __init__(self, profile: str, report: dict):
        self.index, self.module = report["unsafe_after"], report["module"]
        super().__init__(f"fork server (profile {profile!r}): importing {self.module} left it "
                         f"unable to fork ({report['why']}: {', '.join(report['threads'])})")


def _start(profile: str) -> _Client:
    """A server for ``profile``, forked from this process's server of the profile it extends
    (``_BASE``), else spawned. Where one of its preloads leaves it unable to fork (on a CUDA
    machine ``megatron.core`` starts a CUDA driver thread at import), one with the preloads
    before it, with a RuntimeWarning naming the module: its children import that module and
    the rest themselves. OSError when neither starts."""
    base = _base_for(profile)
    try:
        return _Client.start(profile, base=base)
    except UnsafePreload as exc:
        if exc.index == 0:
            raise
        warnings.warn(f"{exc}; it preloads only the {exc.index} modules before it, and its "
                      "children import the rest themselves", RuntimeWarning, stacklevel=4)
        return _Client.start(profile, upto=exc.index, base=base)


def _base_for(profile: str) -> _Client | None:
    """The server to fork ``profile``'s from (started if need be), or None where there is none
    (``_BASE``). OSError when it could not start: this one would import the same modules
    first and fail the same way (a hung import would be waited for twice)."""
    if (name := _BASE[profile]) is None:
        return None
    base = _connected(name)
    if base is None:
        raise OSError(f"fork server (profile {profile!r}): the server of {name!r}, whose "
                      f"preloads it extends, could not start ({_unavailable[name]})")
    return base


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


def attach(conn: socket.socket, imported: dict) -> None:
    """In a child the server has just forked: ``conn`` is the child's own connection to it,
    ``imported`` the server's ``read_at_import`` when it imported torch."""
    global _attached
    _attached = _Client(conn, os.getsid(0), None, imported)


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


@atexit.register
def _close_servers(timeout: float = _CLOSE_TIMEOUT) -> None:
    """At this process's exit, the servers it started (``_servers``; a forked copy of it has
    none of its own) closed, all at once, and waited for: each ends as its connection closes,
    and one still running after ``timeout`` is killed with its session. Left to the kernel's
    closing of the sockets, a server outlived its client by its own shutdown -- the GPU runner
    found one running after every pytest step that used one -- and the collector met the open
    sockets and the spawned server's ``Popen`` (``ResourceWarning``s as pytest's workers
    exited)."""
    mine = [c for c in _servers.values() if c.pid == os.getpid()]
    for client in mine:
        client.sock.close()
    deadline = time.monotonic() + timeout
    for client in mine:
        try:
            client.close(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if _running(client.session):
            _kill_session(client.session, client.proc)
