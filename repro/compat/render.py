"""``matrix.md``: the matrix as markdown tables (repros down, combinations across)."""

from __future__ import annotations

from repro.compat.matrix import Cell, Matrix

_WORDS = {"skipped": "skipped", "could-not-run": "could not run",
          "could-not-install": "could not install", "failed": "FAILED"}
_VERSIONS = ("torch", "spmd-types", "torchtitan", "megatron-core", "megatron-lm-dev",
             "torch-remat", "verl")


def _escape(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def cell_text(cell: Cell) -> str:
    if cell.status == "ok":
        return "reproduced · fixed-passed"
    return f"{_WORDS[cell.status]}: {_escape(cell.reason)}"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def render_markdown(matrix: Matrix) -> str:
    combos = matrix.combinations
    lines = [
        "# Compatibility matrix",
        "",
        f"Every repro, unfixed and fixed (`python -m repro --json`, device {matrix.device}), in "
        f"one virtualenv per released stack combination. Generated {matrix.generated} (last run "
        f"from commit `{matrix.commit}`; each combination's own below) by `tox -m compat` "
        "(`python -m repro.compat`).",
        "",
        "A cell says: **reproduced · fixed-passed** (the bug still reproduces unfixed and our "
        "fix still holds), **FAILED** (which path, and how), **skipped** / **could not run** "
        "(why), or **could not install** (pip's last line).",
        "",
        _row(["repro", *(f"`{c.name}`" for c in combos)]),
        _row(["---"] * (len(combos) + 1)),
    ]
    for repro in matrix.repros:
        lines.append(_row([f"`{repro}`", *(cell_text(matrix.cell(c.name, repro)) for c in combos)]))
    if matrix.summaries:
        lines += ["", "## Repros", ""]
        lines += [f"- `{r}`: {_escape(matrix.summaries[r], 400)}" for r in matrix.repros
                  if r in matrix.summaries]
    lines += ["", "## Combinations", "",
              _row(["combination", "python", *_VERSIONS, "run on", "commit", "install s",
                    "run s"]),
              _row(["---"] * (len(_VERSIONS) + 6))]
    for c in combos:
        versions = [c.installed.get(p, "—") for p in _VERSIONS]
        install = f"{c.install_seconds:.0f}" + (" (reused)" if c.reused_venv else "")
        lines.append(_row([f"`{c.name}`", c.python, *versions, c.date, f"`{c.commit or '?'}`",
                           install, f"{c.run_seconds:.0f}"]))
    lines += ["", "Requested (one pip resolver run per combination, torch pinned):", ""]
    lines += [f"- `{c.name}`: `{' '.join(c.requested)}`; verl: {c.verl}" for c in combos]
    return "\n".join(lines) + "\n"


README_BEGIN, README_END = "<!-- compat:begin -->", "<!-- compat:end -->"


def readme_summary(matrix: Matrix, older: str = "") -> str:
    """The README's line on the committed matrix: when and from which commit it was made, and
    its cells counted by status (``python -m repro.compat`` rewrites it with the matrix).
    ``older``: why the matrix is older than the code it ran (``benchmarks.headline`` says so
    when ``fixes/`` or ``repro/`` changed after its commit); "" when it is not."""
    counts: dict[str, int] = {}
    for combo in matrix.combinations:
        for repro in matrix.repros:
            status = matrix.cell(combo.name, repro).status
            counts[status] = counts.get(status, 0) + 1
    words = {"ok": "reproduced · fixed-passed", **_WORDS}
    tally = ", ".join(f"{counts[s]} {words[s]}" for s in words if counts.get(s))
    commits = sorted({c.commit for c in matrix.combinations if c.commit})
    return (f"The committed matrix describes commit `{matrix.commit}` (generated "
            f"{matrix.generated}; per combination: {', '.join(f'`{c}`' for c in commits)}): "
            f"{len(matrix.repros)} repros x {len(matrix.combinations)} combinations, {tally}."
            + (f" **Older than the code:** {older}; regenerate it with `tox -m compat`."
               if older else ""))


def with_readme_summary(readme: str, matrix: Matrix, older: str = "") -> str:
    """``readme`` with the text between the compat markers replaced by ``readme_summary``;
    ValueError if the markers are missing."""
    try:
        head, rest = readme.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
    except ValueError:
        raise ValueError(f"README has no {README_BEGIN} ... {README_END} block") from None
    return f"{head}{README_BEGIN}\n{readme_summary(matrix, older)}\n{README_END}{tail}"
