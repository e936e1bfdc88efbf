"""The fork server process (repro.harness.forkserver has the why and the protocol): its loop,
the supervisor each request gets, and what a forked child does before it runs its target: the
request's stdio, environment, working directory, sys.path and torch thread count, then the
Python-level part of interpreter shutdown."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
import types
from collections.abc import Mapping

from repro.harness import forkserver


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# This process's environment when it imported torch, which torch read then: the intra-op
# pool's variables (``_threads_asked``) and ``forkserver.READ_AT_IMPORT``. A forked server
# inherits it with torch; a forked child's client compares its requests with it
# (``forkserver.attach``).
_TORCH_IMPORT_ENV: dict[str, str] = dict(os.environ)


def _preload(profile: str, upto: int | None) -> dict | None:
    """Import the profile's first ``upto`` preloads (all: None), checking after each that the
    server can still fork; the first one after which it cannot is reported (its index and why)."""
    global _TORCH_IMPORT_ENV
    for index, name in enumerate(forkserver.PRELOADS[profile][:upto]):
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue  # optional and not installed: the children that need it skip
        had_torch = "torch" in sys.modules
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # a child importing it sees the same error itself
        if not had_torch and "torch" in sys.modules:
            _TORCH_IMPORT_ENV = dict(os.environ)
        if (why := _unsafe_to_fork()) is not None:
            return {"unsafe_after": index, "module": name, "why": why, "threads": _thread_names()}
    return None


def _thread_names() -> list[str]:
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # it has ended
    return names


def _unsafe_to_fork() -> str | None:
    if (n := _os_threads()) != 1:
        return f"the fork server has {n} threads, not 1"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the fork server"
    return None


def serve(fd: int, profile: str, upto: int | None = None) -> None:
    """The server's main loop (``fd``: its end of the client's socket pair), after importing
    the profile's first ``upto`` preloads; its pid is sent first (JSON), then "ready". Each
    child gets a connection of its own to this loop; the server exits when the client's
    closes. A preload that leaves the server unable to fork is reported (JSON:
    ``unsafe_after`` and why) and the server exits. A request of kind "server" forks the
    server of another profile (``_fork_server``)."""
    root = socket.socket(fileno=fd)
    root.send(json.dumps({"pid": os.getpid()}).encode())  # the client kills it by this
    if (unsafe := _preload(profile, upto)) is not None:
        root.send(json.dumps(unsafe).encode())
        return
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
                message, fds, _, _ = socket.recv_fds(conn, forkserver.MAX_MESSAGE, 3)
                if message:
                    request = json.loads(message)
                    fork = _fork_server if request["kind"] == "server" else _fork_request
                    fork(request, fds, sel)
                elif conn is root:
                    return  # the client has gone
                else:
                    sel.unregister(conn)  # a child has ended
                    conn.close()


def _fork_server(request: dict, fds: list[int], sel: selectors.BaseSelector) -> None:
    """Fork the server of a profile whose preloads extend this one's (``fds[0]``: its end of
    the client's new socket pair). It takes the request's environment and the ``sys.path`` its
    PYTHONPATH gives, imports only the rest of its preloads, leads a session of its own as a
    spawned server does, and exits when its client's connection closes, running the atexit
    handlers its own imports registered (not this server's)."""
    fd = fds[0]
    if (why := _unsafe_to_fork()) is not None:
        with socket.socket(fileno=fd) as conn:
            conn.send(why.encode())
        return
    if os.fork() == 0:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
        os.setsid()
        import atexit

        atexit._clear()
        _adopt_environment(request["env"])
        try:
            serve(fd, request["profile"], request["upto"])
        finally:
            atexit._run_exitfuncs()
            os._exit(0)
    os.close(fd)


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
    # A group of its own (a timeout kills what it starts, too) or its requester's (a rank).
    os.setpgid(0, request["group"] or 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # what it starts is forked by this server too
    forkserver.attach(conn, forkserver.read_at_import(_TORCH_IMPORT_ENV))
    _drop_inherited_atexit_handlers()
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


def _drop_inherited_atexit_handlers() -> None:
    """The child starts with none of the server's atexit handlers (those its site start-up
    registered included): the preloads registered them for the server's own state (wandb,
    imported by megatron-core, registers TemporaryDirectory cleanups: the first child to exit
    would delete the server's directory under every later child). multiprocessing's forked
    children skip them too (they end with os._exit); the handlers a child registers itself run
    at its exit (``_shut_down``). logging's handler is the exception: it flushes this
    process's own logging handlers, and a spawned interpreter that imported logging would have
    it, first registered, so run last."""
    import atexit

    atexit._clear()
    logging = sys.modules.get("logging")
    if logging is not None:
        atexit.register(logging.shutdown)


def _threads_asked(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """What ``env`` holds of the variables torch sizes its intra-op pool by:
    (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``)."""
    return env.get("OMP_NUM_THREADS"), env.get("MKL_NUM_THREADS")


def _count(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _set_torch_threads(env: Mapping[str, str]) -> None:
    """torch's intra-op pool sized as the child asks. OpenMP and MKL read the server's
    environment when it imported torch; the child's ``OMP_NUM_THREADS`` (e.g. 1 for a rank)
    must still apply, or ranks side by side would each spin a pool of every core.

    Where the child's variables are the server's at that import, nothing is set: the pool
    starts lazily, sized as the import left it -- exactly a spawned child's (a caller's
    ``OMP_NUM_THREADS=2`` for a whole run once had every forked child begin with two OS
    threads). Where they differ, ``set_num_threads`` with ``MKL_NUM_THREADS``, else
    ``OMP_NUM_THREADS`` (MKL's variable wins in torch too): the pool then starts at once,
    and a count above the physical cores is not capped to them as a spawned child's MKL pool
    is. A child with neither keeps the server's pool (its caller dropped a variable the server
    was started with)."""
    torch = sys.modules.get("torch")
    asked = _threads_asked(env)
    if torch is None or asked == _threads_asked(_TORCH_IMPORT_ENV):
        return
    count = _count(asked[1]) or _count(asked[0])
    if count is not None:
        torch.set_num_threads(count)


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
    module teardown over every preloaded object) is skipped: a child's outcome is
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


def _pythonpath_entries(pythonpath: str) -> list[str]:
    """The ``sys.path`` entries a PYTHONPATH value gives, as the interpreter adds them."""
    return [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]


# sys.path as the server started with it: [path0, *PYTHONPATH entries, *the rest].
_SERVER_PYTHONPATH = _pythonpath_entries(os.environ.get("PYTHONPATH", ""))


def _adopt_environment(env: Mapping[str, str]) -> None:
    """A forked server's environment and ``sys.path`` as a server spawned with ``env`` would
    have them (what its own preloads import under); its children's ``sys.path`` is built from
    this PYTHONPATH on."""
    global _SERVER_PYTHONPATH
    os.environ.clear()
    os.environ.update(env)
    _set_sys_path("code", env.get("PYTHONPATH", ""))
    _SERVER_PYTHONPATH = _pythonpath_entries(env.get("PYTHONPATH", ""))


def _set_sys_path(kind: str, pythonpath: str) -> None:
    """``sys.path`` as the interpreter would build it for this request: the working directory
    ("" for -c, its absolute path for -m), the request's PYTHONPATH, then the installation's."""
    rest = sys.path[1 + len(_SERVER_PYTHONPATH):]
    path0 = "" if kind == "code" else os.getcwd()
    sys.path[:] = [path0, *_pythonpath_entries(pythonpath), *rest]
    importlib.invalidate_caches()
