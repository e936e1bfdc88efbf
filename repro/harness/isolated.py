"""Run Python code in a child process -- a fresh interpreter, or a fork of the fork server
(repro.harness.forkserver) where the caller opts in -- so that a crash (SIGSEGV, CUDA illegal
memory access, a hang) never takes down the caller: the repro runner and the crash tests use
this."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from repro.harness import forkserver as forkserver_module
from repro.harness import forkserver_request
from repro.harness.checkout import with_checkout
from repro.harness.isolated_result import IsolatedResult

__all__ = ["IsolatedResult", "free_loopback_port", "run_isolated", "run_loopback_ranks"]


def run_isolated(
    *,
    code: str | None = None,
    module: str | None = None,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    forkserver: bool | str = False,
) -> IsolatedResult:
    """Run ``python -c code`` or ``python -m module`` with ``args`` in a new process.

    Exactly one of ``code`` and ``module`` is given. ``env`` entries are added to (not
    replacing) the current environment. A child still running after ``timeout`` seconds is
    killed with its whole process group and reported as ``timed_out``.

    ``forkserver``: fork the child from this process's fork server (repro.harness.forkserver:
    torch and friends already imported) instead of starting an interpreter; for children that
    need no fresh interpreter of their own. True: the "torch" profile, or a profile's name
    (``forkserver.PRELOADS``). Spawned anyway where the server is unavailable or
    ``STACKFIX_FORKSERVER=0``.
    """
    if (code is None) == (module is None):
        raise ValueError("run_isolated needs exactly one of code= or module=")
    child_env = dict(os.environ)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    # A child dumping core on SIGSEGV is the expected outcome of a crash repro, not news.
    child_env.setdefault("PYTHONFAULTHANDLER", "1")
    if env:
        child_env.update(env)
    child_env = with_checkout(child_env)
    if forkserver and forkserver_module.enabled():
        kind, target = ("code", code) if code is not None else ("module", module)
        forked = forkserver_request.run(kind, target, args, child_env, cwd, timeout,
                                       profile=_profile(forkserver))
        if forked is not None:
            return forked
    argv = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", module]
    argv += list(args)
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,  # never the parent's stdin (xdist workers talk over it)
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
        cwd=cwd,
        start_new_session=True,  # own process group: a timeout kills its workers too
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        timed_out = True
    return IsolatedResult(
        returncode=None if timed_out else proc.returncode,
        stdout=out,
        stderr=err,
        seconds=time.monotonic() - start,
        timed_out=timed_out,
    )


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loopback_ranks(
    argv: Sequence[str],
    world_size: int,
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    forkserver: bool | str = False,
) -> list[IsolatedResult]:
    """Run ``argv`` once per rank, torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...),
    all on 127.0.0.1 with gloo bound to the loopback interface; wait for every rank.

    ``env`` entries are added to each rank's environment. Ranks still running after
    ``timeout`` seconds (None: no limit) are killed and reported as ``timed_out``.
    ``forkserver``: ranks of ``[sys.executable, "-c" | "-m", ...]`` are forked by the fork
    server (in the caller's process group where it is the server's child), as in run_isolated.
    """
    port = free_loopback_port()
    rank_envs = []
    for rank in range(world_size):
        rank_env = dict(
            os.environ,
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            # loopback only: gloo would otherwise pick the interface of the hostname
            GLOO_SOCKET_IFNAME="lo",
        )
        rank_env.update(env or {})
        rank_envs.append(with_checkout(rank_env))
    if forkserver and forkserver_module.enabled():
        forked = _forked_ranks(argv, rank_envs, timeout, cwd, _profile(forkserver))
        if forked is not None:
            return forked
    start = time.monotonic()
    procs = []
    for rank_env in rank_envs:
        procs.append(subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=rank_env, cwd=cwd,
        ))
    results = []
    try:
        for proc in procs:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            try:
                out, err = proc.communicate(timeout=left)
                timed_out = False
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                timed_out = True
            results.append(IsolatedResult(
                returncode=None if timed_out else proc.returncode, stdout=out, stderr=err,
                seconds=time.monotonic() - start, timed_out=timed_out,
            ))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def _profile(forkserver: bool | str) -> str:
    return "torch" if forkserver is True else forkserver


def _forked_ranks(
    argv: Sequence[str], envs: Sequence[Mapping[str, str]], timeout: float | None,
    cwd: str | None, profile: str,
) -> list[IsolatedResult] | None:
    """The ranks forked by the fork server; None when ``argv`` is not this Python's ``-c`` /
    ``-m`` or the server cannot take them (then they are spawned)."""
    kind = {"-c": "code", "-m": "module"}.get(argv[1]) if len(argv) > 2 else None
    if argv[0] != sys.executable or kind is None:
        return None
    ranks = []
    for env in envs:
        rank = forkserver_request.start(kind, argv[2], argv[3:], env, cwd, own_group=False,
                                       profile=profile)
        if rank is None:  # the server has gone (or cannot take this environment: ``start``):
            # end the ranks it started, spawn them all
            for started in ranks:
                started.kill()
            forkserver_request.collect(ranks, None)
            return None
        ranks.append(rank)
    return forkserver_request.collect(ranks, timeout)
