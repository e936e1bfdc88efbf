"""A request to the fork server (repro.harness.forkserver has the why and the protocol):
``start`` has it fork one child with its own stdout, stderr and status socket, ``collect``
reads children to their end (killing those past the timeout), ``run`` is both for one child."""

from __future__ import annotations

import json
import locale
import os
import selectors
import signal
import socket
import time
from collections.abc import Mapping, Sequence

from repro.harness import forkserver
from repro.harness.isolated_result import IsolatedResult


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

    None when the server cannot take the request (it could not start or has gone, or the
    child asks other values of what torch read when the server imported it:
    ``forkserver.READ_AT_IMPORT``): the caller then spawns the child itself.
    """
    client = forkserver._connected(profile)
    if client is None or forkserver.read_at_import(env) != client.imported:
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
