"""CPU time by process while a command runs, grouped by what each process is:
``python -m benchmarks.proc_cpu [--json OUT] [--interval S] -- COMMAND...``.

Why: the CPU suite starts hundreds of interpreters (fork servers, the children forked from
them, spawned children, inner pytest sessions), and pytest's ``--durations`` shows only the
wall time of the test that waited for them. This samples ``/proc`` (Linux) every
``--interval`` seconds for the command's process and everything it starts.

What is exact and what is attributed:
- The total is exact: the command is reaped with ``wait4``, whose usage counts the command and
  every process reaped inside its tree (what ``time`` prints), plus what the processes that
  outlived their parent were seen to use (an orphan's usage reaches no parent of the tree).
- Each process's figure is its user + system CPU as last sampled, plus its tail: what it used
  after that sample. A sample cannot see the tail, but the parent that reaps a process adds its
  whole usage to its own reaped-children counters (``/proc/PID/stat`` cutime + cstime), so the
  growth of the parent's counters less what was sampled of the processes it reaped is their
  tails. Where several processes under one parent exit between two samples, their tails are split
  by what each was seen to use. A parent read while one of its children was being reaped is
  settled at its next sample instead (the two reads are not one snapshot).
- What no sampled process can own -- a process that lived less than one interval and exited
  alone, what a process had reaped before it was first seen -- is the row ``not attributed``.
  Sampling is a lower bound only there: the figures sum to the total.

Groups: a fork server started by its client (``spawned server``, by profile), one forked from
another server (``forked server``: repro.harness.forkserver's profiles that extend another),
what a server forks per request (``forked child``: the child and its supervisor), an xdist
worker, ``python -m repro`` runs, spawned ``repro.child`` and inner pytest runs, and other
Python processes by their first words.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SERVE = re.compile(r"forkserver_process import serve; serve\(\d+, '(\w+)', (\w+)\)")


_US = 0  # the sampler, parent of the command: pid 0 is never a process under /proc


@dataclass
class Proc:
    pid: int
    ppid: int
    session: int
    cmdline: str
    cpu: float = 0.0  # user + system as last sampled (a forked process's counters start at zero)
    reaped: float = 0.0  # cutime + cstime as last sampled: what its reaped children used
    tail: float = 0.0  # what it used after its last sample, from its reaper's counters
    alive: bool = True

    @property
    def total(self) -> float:
        return self.cpu + self.tail


@dataclass
class Reaper:
    """The reaped-children counters of one process (or of the sampler, for the command), and the
    processes it reaped whose tails are not yet settled from them."""

    settled: float  # the counters' value that the sampled usage and settled tails account for
    unsettled: list[Proc] = field(default_factory=list)


def _read(pid: int) -> tuple[int, int, float, float, str] | None:
    """(ppid, session, own CPU s, reaped children's CPU s, cmdline) of ``pid``; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    ppid, session = int(fields[1]), int(fields[3])
    own = (int(fields[11]) + int(fields[12])) / _TICK
    return ppid, session, own, (int(fields[13]) + int(fields[14])) / _TICK, cmdline


def _listed() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


class Sampler:
    """The processes of one command and the accounts of their reapers (see the module's doc)."""

    def __init__(self, root: int):
        self.root = root
        self.procs: dict[int, Proc] = {}
        self.reapers: dict[int, Reaper] = {_US: Reaper(0.0)}
        self.not_attributed = 0.0

    def _depth(self, proc: Proc) -> int:
        depth = 0
        while proc.pid != self.root and proc.ppid in self.procs:
            proc, depth = self.procs[proc.ppid], depth + 1
        return depth

    def _reaper(self, proc: Proc, gone: set[int]) -> int | None:
        """Whose counters ``proc``'s usage reached: the nearest ancestor still alive (one that
        exited in the same interval passed it on), the sampler for the command; None for a
        process whose parent died before it (an orphan is reaped outside the tree)."""
        while proc.pid != self.root:
            parent = self.procs.get(proc.ppid)
            if parent is None or not (parent.alive or parent.pid in gone):
                return None
            if parent.pid not in gone:
                return parent.pid
            proc = parent
        return _US

    def sample(self) -> None:
        listed = _listed()
        gone = {p.pid for p in self.procs.values() if p.alive and p.pid not in listed}
        racing: list[Proc] = []  # listed, then gone before their read: reaped during the sample
        # Known processes ancestors first: a child read after its parent that is still there
        # was not reaped before the parent's read. Processes listed but not yet known last.
        known = sorted((p for p in self.procs.values() if p.alive and p.pid in listed),
                       key=self._depth)
        for proc in known:
            info = _read(proc.pid)
            if info is None:
                gone.add(proc.pid)
                racing.append(proc)
                continue
            proc.ppid, proc.session, proc.cpu, proc.reaped, cmdline = info
            proc.cmdline = cmdline or proc.cmdline  # a zombie's is empty
        for pid in sorted(listed - self.procs.keys()):
            info = _read(pid)
            if info is None:
                continue
            ppid, session, cpu, reaped, cmdline = info
            if pid != self.root and ppid not in self.procs:
                continue  # not the command's (or its parent was never seen)
            self.procs[pid] = Proc(pid, ppid, session, cmdline, cpu, reaped)
            self.reapers[pid] = Reaper(reaped)
            self.not_attributed += reaped  # reaped before it was seen: no process of ours owns it
        for pid in gone:
            # Its reaper's counters grow by its usage and by all its own counters hold: what
            # they had accounted for passes on, and so do the processes it had not settled.
            proc, own = self.procs[pid], self.reapers.pop(pid)
            reaper = self._reaper(proc, gone)
            if reaper is not None:
                self.reapers[reaper].settled += proc.cpu + own.settled
                self.reapers[reaper].unsettled += [proc, *own.unsettled]
        # a reaper read before its child's reap or after it: settled at its next sample
        busy = {self._reaper(proc, gone) for proc in racing}
        for pid in gone:
            self.procs[pid].alive = False
        for pid, proc in self.procs.items():
            if proc.alive and pid not in busy:
                self.settle(pid, proc.reaped)

    def settle(self, pid: int, counters: float) -> None:
        """Give the growth of ``pid``'s reaped counters beyond what was sampled to the
        processes it reaped since it last settled, split by what each was seen to use; with
        none to give it to, it is not attributed."""
        account = self.reapers[pid]
        tails = counters - account.settled
        if tails < 0:
            return  # a child sampled before its reap reached these counters: settle next time
        account.settled = counters
        members, account.unsettled = account.unsettled, []
        if not members:
            self.not_attributed += tails
            return
        seen = sum(p.total for p in members)
        for p in members:
            p.tail += tails * (p.total / seen if seen > 0 else 1 / len(members))


def sample(command: list[str], interval: float) -> tuple[int, float, Sampler]:
    """Run ``command``; its exit status, wall seconds and the sampler that followed it."""
    start = time.monotonic()
    child = subprocess.Popen(command)
    sampler = Sampler(child.pid)
    while True:
        # wait4, not poll: the usage of the command's whole reaped tree is the exact total
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        sampler.sample()
        if pid:
            break
        time.sleep(interval)
    child.returncode = os.waitstatus_to_exitcode(status)
    sampler.settle(_US, usage.ru_utime + usage.ru_stime)
    return child.returncode, time.monotonic() - start, sampler


def role(proc: Proc, procs: dict[int, Proc]) -> str:
    cmd = proc.cmdline
    if "forkserver_process import serve" in cmd:
        parent = procs.get(proc.ppid)
        if proc.session != proc.pid:
            return "forked child (and its supervisor)"
        if parent is not None and "forkserver_process import serve" in parent.cmdline:
            return "forked server (a profile extending another's)"
        match = _SERVE.search(cmd)
        if match is None:
            return "spawned server"
        profile, upto = match.groups()
        return f"spawned server, profile {profile}" + ("" if upto == "None" else f"[:{upto}]")
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "xdist worker"
    words = cmd.split()
    if "repro.child" in words:
        return "spawned repro.child"
    if "-mpytest" in words or ("-m" in words and "pytest" in words):
        return "spawned inner pytest"
    if "-m" in words and words.index("-m") + 1 < len(words):
        return f"python -m {words[words.index('-m') + 1]}"
    if "-c" in words:
        return "python -c " + " ".join(words[words.index("-c") + 1:])[:48]
    return " ".join(words[:2])[:60] or "(exited before its command line was read)"


def summary(sampler: Sampler) -> list[dict]:
    """One row per role, most CPU first; then what no sampled process owns."""
    groups: dict[str, list[Proc]] = defaultdict(list)
    for proc in sampler.procs.values():
        groups[role(proc, sampler.procs)].append(proc)
    rows = [{"role": name, "processes": len(members),
             "cpu_s": round(sum(p.total for p in members), 2)} for name, members in groups.items()]
    rows.sort(key=lambda r: -r["cpu_s"])
    return rows + [{"role": "not attributed", "processes": 0,
                    "cpu_s": round(sampler.not_attributed, 2)}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.proc_cpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (python -m benchmarks.proc_cpu -- COMMAND...)")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    if not os.path.isdir("/proc/self/task"):
        parser.error("needs Linux /proc")
    code, wall, sampler = sample(command, args.interval)
    rows = summary(sampler)
    total = sum(r["cpu_s"] for r in rows)
    cores = os.cpu_count() or 1
    print(f"\n{'cpu s':>8} {'procs':>6}  role")
    for r in rows:
        print(f"{r['cpu_s']:8.1f} {r['processes']:6d}  {r['role']}")
    print(f"{total:8.1f} {len(sampler.procs):6d}  in all; wall {wall:.1f} s x {cores} cores = "
          f"{wall * cores:.1f} core-seconds; exit status {code}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "exit_status": code, "wall_s": round(wall, 2),
                       "cores": cores, "interval_s": args.interval, "cpu_s": round(total, 2),
                       "processes": len(sampler.procs), "groups": rows}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
