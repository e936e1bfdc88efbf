"""``python -m repro.compat``: run the repros in every combination's venv and write the matrix.

Exit status: 0 when the matrix was written and no cell failed or could not install, 1 when one
did, 2 on bad arguments."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from repro.compat.combos import by_name, for_device
from repro.compat.matrix import Matrix
from repro.compat.render import render_markdown, with_readme_summary
from repro.compat.run import now, repro_summaries, run_combination
from repro.compat.upstream import PROJECTS, parse_checkout, upstream_combination
from repro.compat.venvs import uv_binary
from repro.registry import DEVICES

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "compat"
ROOT_ENV = "STACKFIX_COMPAT_ROOT"
DEFAULT_ROOT = "~/.cache/stackfix/compat-envs"


# The code the cells run: a change elsewhere (the matrix a previous run wrote, the README's line
# on it) leaves the run's commit clean.
RUN_CODE = ("fixes", "repro")


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)

    head = git("rev-parse", "--short=8", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--", *RUN_CODE).stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def write(matrix: Matrix, out: Path) -> None:
    """matrix.json and matrix.md in ``out``; the committed matrix's also updates the README's
    line on it (which commit it describes)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(matrix.to_json(), indent=1) + "\n")
    (out / "matrix.md").write_text(render_markdown(matrix))
    if out.resolve() == DEFAULT_OUT.resolve():
        readme = REPO / "README.md"
        readme.write_text(with_readme_summary(readme.read_text(), matrix))


def _load(path: Path) -> Matrix:
    return Matrix.from_json(json.loads(path.read_text()))


def _merge(paths: list[str]) -> Matrix | None:
    try:
        parts = [_load(Path(p)) for p in paths]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    matrix = parts[0]
    for part in parts[1:]:
        matrix = matrix.merged(part)
    return matrix.with_missing(for_device(matrix.device), "no result: its run left no matrix.json")


def _run(args, combos, out: Path, upstream: dict | None = None) -> Matrix | None:
    """Run ``combos``; ``upstream``: cell name -> (distribution, checkout commit) of the cells
    built from checkouts (their versions say the commit)."""
    upstream = upstream or {}
    previous = None
    if (args.only or upstream) and (out / "matrix.json").is_file():
        previous = _load(out / "matrix.json")
        if previous.device != args.device:
            print(f"error: {out}/matrix.json is a {previous.device} matrix; use another --out",
                  file=sys.stderr)
            return None
    start = time.monotonic()
    if args.wheels:  # read by every pip the venvs run (verl's installer included), passed to uv
        os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(Path(args.wheels).resolve()))
    commit = _commit()
    uv = uv_binary()
    print(f"installing with {uv or 'pip (no uv found: pip install uv, or tox -m compat)'}",
          file=sys.stderr)
    results = [run_combination(c, Path(args.root).expanduser(), REPO, device=args.device,
                               reinstall=args.reinstall, uv=uv,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
               for c in combos]
    for result in results:
        result.commit = commit
        if result.name in upstream:
            dist, checkout = upstream[result.name]
            result.installed[dist] = f"{result.installed.get(dist, '?')} @ {checkout[:8]}"
    ran = [r for r in results if r.failure is None]
    summaries = repro_summaries(str(Path(args.root).expanduser() / ran[0].name / "bin" / "python"),
                                REPO) if ran else {}
    matrix = Matrix(now(), commit, args.device, results, summaries)
    print(f"matrix: {len(results)} combination(s) in {time.monotonic() - start:.0f}s",
          file=sys.stderr)
    return matrix if previous is None else previous.merged(matrix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.compat", description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the combinations and exit")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this combination (repeatable); merged into --out's matrix")
    parser.add_argument("--root", default=os.environ.get(ROOT_ENV, DEFAULT_ROOT),
                        help=f"where the venvs live (${ROOT_ENV}, default {DEFAULT_ROOT})")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="directory for matrix.json/.md")
    parser.add_argument("--reinstall", action="store_true", help="rebuild the venvs")
    parser.add_argument("--device", default="cpu", choices=DEVICES,
                        help="python -m repro --device (default cpu; cuda for a GPU column)")
    parser.add_argument("--wheels", metavar="DIR",
                        help="install offline from the wheels in DIR (pip --no-index --find-links)")
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                        help=f"a git checkout of {' or '.join(PROJECTS)} as a cell of its own, in "
                        "place of the released package (repeatable; run alone, merged into "
                        "--out's matrix)")
    parser.add_argument("--base", metavar="NAME", help="the combination a --checkout cell "
                        "starts from (default: the first whose Python the project supports)")
    parser.add_argument("--merge", nargs="+", metavar="MATRIX_JSON",
                        help="run nothing: merge these matrix.json files (later wins) into --out")
    args = parser.parse_args(argv)

    if args.list:
        for c in for_device(args.device):
            print(f"{c.name:42} python {c.python}  {' '.join(c.requirements)}  verl={c.verl}")
        return 0
    upstream: dict[str, tuple[str, str]] = {}
    try:
        combos = by_name(args.only, args.device)
        if args.checkout:
            base = by_name([args.base], args.device)[0] if args.base else None
            combos = []
            for spec in args.checkout:
                project, path = parse_checkout(spec)
                combo, commit = upstream_combination(project, path, base)
                combos.append(combo)
                upstream[combo.name] = (PROJECTS[project], commit)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    matrix = _merge(args.merge) if args.merge else _run(args, combos, out, upstream)
    if matrix is None:
        return 2
    matrix = matrix.ordered(for_device(matrix.device))
    write(matrix, out)
    print(render_markdown(matrix))
    bad = matrix.problems()
    if bad:
        print(f"failed or could not install: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
