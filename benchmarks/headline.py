"""The headline cells: the figures the README quotes, read from the committed results.

    python -m benchmarks.headline [--readme README.md] [--check]

``HEADLINES`` names the cells (device kind, scenario, figures; "checkpointed stack": the
bench's megatron-core checkpoints whose layers leak as Megatron-LM #3221; "MoE GPT": a real
megatron-core GPT, 8 experts, full recompute; EP=2: its experts on two GPUs, rank 0's figures);
``headline_rows`` reads each from the latest run of that scenario on that kind
(``benchmarks._views``; for the kind ``gpu``, on the GPU card whose run of it is the newest,
``current_gpu_view``, the row naming the card), one row per strategy (no reclaim, each verl
release, the rival fixes where the family measures them, ours) with its figures and ours
against it, and (given a ``History``) whether the run is older than the code it measures
(``benchmarks._freshness``). The dashboard's summary table (``COLUMNS``: every cell, one row
per strategy, ours against each) and the README's (``README_COLUMNS``: one row per cell it shows,
``peak / kept`` per strategy; written by ``update_readme`` between ``README_BEGIN`` and
``README_END``, and the compat matrix's line between its own markers, saying when the matrix is
older than the code; nothing else of the file touched) are both drawn from these rows, so neither
is copied by hand. The command writes the
README's block from the committed runs (``benchmarks._published``); ``--check`` writes nothing
and exits 1 when the block differs (``test_readme_figures.py`` runs it). A cell with no
committed run reads "not run". Standard library only.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks._compare import REFERENCES, RIVAL_FAMILIES, RIVALS, SUBJECT, Versus, versus
from benchmarks._freshness import Freshness, History, freshness
from benchmarks._published import RESULTS_DIR, published_runs
from benchmarks._results import ResultsError, Row, Run
from benchmarks._views import ScenarioView, committed_runs, current_gpu_view, scenario_views

README_BEGIN = ("<!-- headline:begin (generated: python -m benchmarks.dashboard "
                "-o benchmarks/results/dashboard.html --readme README.md) -->")
README_END = "<!-- headline:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"
MiB = 2**20


GPU = "gpu"  # a headline cell's kind: the newest run of its scenario on any GPU card


@dataclass(frozen=True, slots=True)
class Headline:
    kind: str  # a device kind, or GPU
    scenario: str
    metrics: tuple[str, ...]
    what: str
    in_readme: bool = True  # the README shows one size per model and device; the dashboard all


HEADLINES = (
    Headline("cpu", "recompute-reclaim/chunked-mtp", ("peak_bytes", "end_of_backward_bytes"),
             "checkpointed stack, chunked MTP input"),
    Headline("cpu", "recompute-reclaim/plain", ("peak_bytes", "end_of_backward_bytes"),
             "checkpointed stack, no aliasing"),
    Headline("cpu", "megatron-scale/moe/256x256/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=256 S=256 fp32"),
    Headline(GPU, "megatron-scale/moe/1024x2048/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=1024 S=2048 fp32", in_readme=False),
    Headline(GPU, "megatron-scale/moe/2048x4096/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=2048 S=4096 fp32"),
    Headline(GPU, "megatron-scale/moe-ep2/2048x4096/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=2048 S=4096, EP=2"),
    Headline(GPU, "recompute-reclaim/chunked-mtp", ("peak_bytes", "end_of_backward_bytes"),
             "checkpointed stack, chunked MTP input"),
)

@dataclass(frozen=True, slots=True)
class HeadlineRow:
    """One strategy of one headline cell, from one run: its figures and ours against them."""

    cell: Headline
    title: str  # the strategy as the table names it ("no reclaim", "verl 0.8.0", ..., "ours")
    row: Row | None  # None when the run has no row of that strategy
    subject: Row | None  # ours, in the same run
    run_label: str  # "" when the cell has no committed run
    anchor_key: tuple[str, str]  # (the device kind its run measured -- a card, for a GPU
    # cell --, the scenario): its section's
    freshness: Freshness | None = None  # whether the run is older than the code it measures
    first: bool = True  # the cell's first row: the one that names the cell and its run

    @property
    def kind(self) -> str:
        """The device kind its run measured (a card, for a GPU cell)."""
        return self.anchor_key[0]

    @property
    def is_subject(self) -> bool:
        return self.title == SUBJECT

    def versus(self, metric: str) -> Versus | None:
        """Ours against this row on ``metric`` (None for ours' own row)."""
        return None if self.is_subject else versus(self.subject, self.row, metric)


def _strategies(cell: Headline) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The strategies a cell's rows show, in order: each reference, the rival fixes where the
    family measures them, ours."""
    rivals = RIVALS if cell.scenario.split("/")[0] in RIVAL_FAMILIES else ()
    return (*REFERENCES, *rivals, (SUBJECT, (SUBJECT,)))


def headline_rows(views: list[ScenarioView], cells=HEADLINES, *,
                  history: History | None = None) -> list[HeadlineRow]:
    """The rows of ``cells`` from ``views`` (one per cell and strategy); with ``history``, each
    says whether its run is older than the code it measures."""
    by_key = {(v.kind, v.scenario): v for v in views}
    rows = []
    for cell in cells:
        view = (current_gpu_view(views, cell.scenario) if cell.kind == GPU
                else by_key.get((cell.kind, cell.scenario)))
        kind = view.kind if view is not None else cell.kind
        latest = view.latest.rows if view else {}
        age = (freshness(view.latest.run.commit, cell.scenario.split("/")[0], history)
               if view is not None and history is not None else None)
        for i, (title, names) in enumerate(_strategies(cell)):
            row = next((latest[n] for n in names if n in latest), None)
            rows.append(HeadlineRow(cell, title, row, latest.get(SUBJECT),
                                    view.latest.label if view else "", (kind, cell.scenario),
                                    age, first=i == 0))
    return rows


def mib(value: float) -> str:
    v = value / MiB
    return f"{v:.2f}" if abs(v) < 1000 else f"{v:.1f}"


def figure_text(row: Row | None, metric: str) -> str:
    if row is None:
        return "not run"
    if row.crashed:
        return f"crashed ({row.crashed})"
    value = row.metrics.get(metric)
    return "--" if value is None else mib(value)


def versus_text(v: Versus | None) -> str:
    """``ratio (difference)``, the difference in MiB: ``0.980 (-160.0)``."""
    if v is None or v.ratio is None:
        return "--"
    diff = "±0" if v.difference == 0 else ("+" if v.difference > 0 else "") + mib(v.difference)
    return f"{v.ratio:.3f} ({diff})"


# Every cell's figures are its peak and what the step leaves: live at the end of backward (the
# checkpointed stack) or kept between steps beyond the model and its grads (the MoE GPT).
FIGURE_COLUMNS = ("peak", "after backward")
COLUMNS = ("what", "device", "strategy",
           *(c for f in FIGURE_COLUMNS for c in (f, f"{SUBJECT} / it (diff)")), "run")


def cells_of(row: HeadlineRow) -> list[str]:
    """The row's cells in ``COLUMNS`` order, as text (figures in MiB); the cell, its device and
    its run are named on the cell's first row only."""
    figures = []
    for metric in row.cell.metrics:
        figures.append(figure_text(row.row, metric))
        if row.is_subject:
            figures.append("")
        elif row.row is not None and row.row.crashed:
            figures.append("-- (crashed)")
        else:
            figures.append(versus_text(row.versus(metric)))
    if not row.first:
        return ["", "", row.title, *figures, ""]
    return [row.cell.what, row.kind, row.title, *figures, _run_cell(row)]


def _run_cell(row: HeadlineRow) -> str:
    """The run's label, and where it is older than the code it measures, that and the paths."""
    if not row.run_label:
        return "not run"
    words = row.freshness.short() if row.freshness is not None else ""
    return f"{row.run_label}, {words}" if words else row.run_label


def markdown(rows: list[HeadlineRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = cells_of(row)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# The README's table: one row per cell it shows (``Headline.in_readme``), one column per strategy,
# each figure pair as ``peak / kept`` in MiB. The dashboard's table (``COLUMNS``) has every cell,
# one row per strategy, and ours against each.
README_COLUMNS = ("MiB peak / kept", *(t for t, _ in REFERENCES), *(t for t, _ in RIVALS),
                  SUBJECT, "run")


def pair_text(row: Row | None, metrics: tuple[str, ...]) -> str:
    """A strategy's figures as the README shows them: ``34.83 / 30.08``, or why there are none
    (``not run``, ``crashed (SIGSEGV)``)."""
    if row is None or row.crashed:
        return figure_text(row, metrics[0])
    return " / ".join(figure_text(row, m) for m in metrics)


def readme_markdown(rows: list[HeadlineRow]) -> str:
    """The README's table of ``rows``: a strategy its cell's family does not measure (the rival
    fixes outside megatron-scale) reads ``--``."""
    cells: dict[Headline, dict[str, HeadlineRow]] = {}
    for row in rows:
        if row.cell.in_readme:
            cells.setdefault(row.cell, {})[row.title] = row
    lines = ["| " + " | ".join(README_COLUMNS) + " |", "|" + "---|" * len(README_COLUMNS)]
    for cell, by_title in cells.items():
        figures = [pair_text(by_title[t].row, cell.metrics) if t in by_title else "--"
                   for t in README_COLUMNS[1:-1]]
        first = next(iter(by_title.values()))
        text = [f"{cell.what} ({first.kind})", *figures, _run_cell(first)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in text) + " |")
    return "\n".join(lines)


def readme_block(rows: list[HeadlineRow]) -> str:
    """What goes between the README's markers: the table and how to read it."""
    return (readme_markdown(rows) + "\n\nMiB; `peak / kept`: the step's peak and what it leaves, "
            "live at the end of backward (checkpointed stack) or kept between steps beyond the "
            "model and its grads (MoE GPT). CPU: MemTracker, `tox -e bench`; GPU: CUDA peak "
            "stats, `python3 ci/gpu_run.py --parallel refresh` (the newest run on any card, "
            "named). The rival fixes (Megatron-LM #6339, "
            "radixark/miles #2862's `gc.collect()`) run on the MoE GPT only. `run`: the commit and "
            "date (UTC) of the row's run, \"older than the code\" where a later commit changed what "
            "it measures (`benchmarks/_freshness.py`). One size per model and device here; every "
            "size, ours against each strategy, step times and the other benchmarks: "
            "[`benchmarks/results/dashboard.html`](benchmarks/results/dashboard.html).\n")


def block_span(text: str, path: str | Path = "README.md") -> tuple[int, int]:
    """Where the generated block's content lies in ``text`` (after the begin marker's line, up
    to the end marker). ResultsError when the markers are missing or out of order."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ResultsError(f"{path}: no '{README_BEGIN}' ... '{README_END}' block to fill")
    return begin + len(README_BEGIN), end


def with_block(text: str, table: str, path: str | Path = "README.md") -> str:
    start, end = block_span(text, path)
    return text[:start] + "\n" + table.rstrip("\n") + "\n" + text[end:]


def update_readme(path: str | Path, table: str) -> bool:
    """Put ``table`` between the README's markers; True if the file changed. ResultsError (a
    ValueError) when the markers are missing or out of order (nothing is written then)."""
    path = Path(path)
    text = path.read_text()
    new = with_block(text, table, path)
    if new != text:
        path.write_text(new)
    return new != text


def readme_table(runs: list[Run], *, include_dirty: bool = False,
                 history: History | None = None) -> str:
    """The README's generated block for ``runs`` (the committed ones: ``benchmarks._published``),
    each row's run judged against ``history`` (default: this checkout's)."""
    shown, _ = committed_runs(runs, include_dirty=include_dirty)
    return readme_block(headline_rows(scenario_views(shown), history=history or History()))


def write_readme(path: str | Path, runs: list[Run]) -> bool:
    return update_readme(path, readme_table(runs))


COMPAT_MATRIX = RESULTS_DIR.parent / "compat" / "matrix.json"


def with_compat_summary(text: str, matrix_path: Path = COMPAT_MATRIX,
                        history: History | None = None) -> str:
    """``text`` with the README's compat line regenerated from the committed matrix, saying
    "older than the code" when ``fixes/`` or ``repro/`` changed after the commit any of its
    combinations ran (as the figures' rows do: a matrix merged from runs at several commits is as
    old as its oldest). ``text`` unchanged when it has no compat block or no matrix exists."""
    import json

    from repro.compat.matrix import Matrix
    from repro.compat.render import README_BEGIN as C_BEGIN
    from repro.compat.render import with_readme_summary

    if C_BEGIN not in text or not matrix_path.is_file():
        return text
    matrix = Matrix.from_json(json.loads(matrix_path.read_text()))
    history = history or History()
    commits = {c.commit or matrix.commit for c in matrix.combinations} or {matrix.commit}
    ages = [freshness(commit.removesuffix("-dirty"), "compat", history) for commit in commits]
    changed = sorted({path for age in ages for path in age.changed})
    # no commit named: the line changes only when the matrix's age does (as the table's rows)
    older = f"{', '.join(changed) or 'its code'} changed after it" if any(a.stale for a in ages) else ""
    return with_readme_summary(text, matrix, older)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=(
        "Write (or --check) README.md's generated figure table from the committed runs."))
    parser.add_argument("--readme", type=Path, default=README, help="default: the repository's")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the "
                        "README's block differs from what the committed runs give")
    args = parser.parse_args(argv)
    try:
        runs = published_runs(args.results_dir)
        text = args.readme.read_text()
        new = with_compat_summary(with_block(text, readme_table(runs), args.readme))
    except (OSError, ResultsError) as e:
        print(f"headline: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"headline: {args.readme}'s generated table differs from the committed runs'; "
                  f"regenerate it: python -m benchmarks.headline --readme {args.readme}",
                  file=sys.stderr)
            return 1
        print(f"headline: {args.readme}'s generated table matches the committed runs")
        return 0
    if new != text:
        args.readme.write_text(new)
    print(f"headline: {args.readme}: {'rewritten' if new != text else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
