"""CPU time by process while a command runs, grouped by what each process is:
``python -m benchmarks.proc_cpu [--json OUT] [--interval S] -- COMMAND...``.

Why: the CPU suite starts hundreds of interpreters (fork servers, the children forked from
them, spawned children, inner pytest sessions), and pytest's ``--durations`` shows only the
wall time of the test that waited for them. This samples ``/proc`` (Linux) every
``--interval`` seconds and sums each process's user + system CPU from the moment it is first
seen, for the command's process and everything it starts. A process that lives less than one
interval, and the last interval of each, are not seen: the figures are lower bounds.

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
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SERVE = re.compile(r"forkserver_process import serve; serve\(\d+, '(\w+)', (\w+)\)")


@dataclass
class Proc:
    pid: int
    ppid: int
    session: int
    cmdline: str
    cpu: float = 0.0  # from its fork on (a forked process's counters start at zero)


def _read(pid: int) -> tuple[int, int, float, str] | None:
    """(ppid, session, user+system CPU seconds, cmdline) of ``pid``, None if it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    ppid, session = int(fields[1]), int(fields[3])
    return ppid, session, (int(fields[11]) + int(fields[12])) / _TICK, cmdline


def sample(command: list[str], interval: float) -> tuple[int, float, dict[int, Proc]]:
    """Run ``command``; its exit status, wall seconds and every process of it that was seen."""
    start = time.monotonic()
    child = subprocess.Popen(command)
    procs: dict[int, Proc] = {}
    while True:
        done = child.poll() is not None
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            info = _read(pid)
            if info is None:
                continue
            ppid, session, cpu, cmdline = info
            seen = procs.get(pid)
            if seen is None:
                if pid != child.pid and ppid not in procs:
                    continue  # not the command's (or its parent was never seen)
                procs[pid] = seen = Proc(pid, ppid, session, cmdline)
            seen.cpu = cpu
            seen.cmdline = cmdline or seen.cmdline  # a zombie's is empty
            seen.session = session
        if done:
            return child.returncode, time.monotonic() - start, procs
        time.sleep(interval)


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


def summary(procs: dict[int, Proc]) -> list[dict]:
    groups: dict[str, list[Proc]] = defaultdict(list)
    for proc in procs.values():
        groups[role(proc, procs)].append(proc)
    rows = [{"role": name, "processes": len(members),
             "cpu_s": round(sum(p.cpu for p in members), 2)} for name, members in groups.items()]
    return sorted(rows, key=lambda r: -r["cpu_s"])


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
    code, wall, procs = sample(command, args.interval)
    rows = summary(procs)
    total = sum(r["cpu_s"] for r in rows)
    cores = os.cpu_count() or 1
    print(f"\n{'cpu s':>8} {'procs':>6}  role")
    for r in rows:
        print(f"{r['cpu_s']:8.1f} {r['processes']:6d}  {r['role']}")
    print(f"{total:8.1f} {len(procs):6d}  in all; wall {wall:.1f} s x {cores} cores = "
          f"{wall * cores:.1f} core-seconds; exit status {code}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "exit_status": code, "wall_s": round(wall, 2),
                       "cores": cores, "interval_s": args.interval, "cpu_s": round(total, 2),
                       "processes": len(procs), "groups": rows}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
