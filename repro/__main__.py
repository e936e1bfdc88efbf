"""``python -m repro``: every repro, unfixed and fixed, each in its own child interpreter.

Exit status: 0 when every repro that ran reproduced its crash unfixed and passed fixed,
1 otherwise, 2 on bad arguments (unknown repro or device, CUDA asked for but absent)."""

from __future__ import annotations

import argparse
import json
import sys

from repro.registry import DEVICES, discover
from repro.runner import run_repro


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro", description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the repros and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only NAME (repeatable)")
    parser.add_argument("--device", default="cpu", help=f"one of {', '.join(DEVICES)} (default cpu)")
    parser.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON")
    args = parser.parse_args(argv)

    if args.device not in DEVICES:
        print(f"error: unknown device {args.device!r}; allowed: {', '.join(DEVICES)}", file=sys.stderr)
        return 2
    repros = discover()
    if args.list:
        for r in repros.values():
            print(f"{r.name:34} [{','.join(r.devices)}] {r.summary}")
        return 0
    names = args.only or list(repros)
    unknown = [n for n in names if n not in repros]
    if unknown:
        print(f"error: unknown repro {', '.join(map(repr, unknown))}; known: {', '.join(repros)}",
              file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda asked for, but torch.cuda.is_available() is False",
                  file=sys.stderr)
            return 2

    outcomes = []
    rows = [["repro", "device", "unfixed", "fixed", "seconds"]]
    for name in names:
        o = run_repro(repros[name], args.device)
        outcomes.append(o)
        mark = "" if o.good else "  <-- FAIL"
        rows.append([name, o.device, f"{o.unfixed.status}: {o.unfixed.detail}",
                     f"{o.fixed.status}: {o.fixed.detail}",
                     f"{o.unfixed.seconds + o.fixed.seconds:.1f}{mark}"])
        print(f"[{'ok' if o.good else 'FAIL'}] {name} ({args.device})", file=sys.stderr, flush=True)
    print(_table(rows))
    bad = [o.name for o in outcomes if not o.good]
    print(f"\n{len(outcomes) - len(bad)} good, {len(bad)} bad" + (f": {', '.join(bad)}" if bad else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([o.as_dict() for o in outcomes], f, indent=2)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
