"""The headline cells: the figures the README quotes, read from the committed results.

``HEADLINES`` names the cells (device kind, scenario, figures; "checkpointed stack": the
bench's megatron-core checkpoints whose layers leak as Megatron-LM #3221; "MoE GPT": a real
megatron-core GPT, 8 experts, full recompute; EP=2: its experts on two GPUs, rank 0's figures);
``headline_rows`` reads each
from the latest run of that scenario on that kind (``benchmarks._views``), with every strategy's
figure and ours against no reclaim and each verl release. The dashboard's summary table and the
README's table (``update_readme``, between ``README_BEGIN`` and ``README_END``, nothing else of
the file touched) are both drawn from these rows, so neither is copied by hand:
``python -m benchmarks.dashboard -o benchmarks/results/dashboard.html --readme README.md``.
A cell with no committed run reads "not run". Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks._compare import REFERENCES, SUBJECT, Versus, reference_rows, versus
from benchmarks._results import Row
from benchmarks._views import ScenarioView

README_BEGIN = "<!-- headline:begin (generated: python -m benchmarks.dashboard --readme README.md) -->"
README_END = "<!-- headline:end -->"
MiB = 2**20


@dataclass(frozen=True, slots=True)
class Headline:
    kind: str
    scenario: str
    metrics: tuple[str, ...]
    what: str


HEADLINES = (
    Headline("cpu", "recompute-reclaim/chunked-mtp", ("peak_bytes", "end_of_backward_bytes"),
             "checkpointed stack, chunked MTP input"),
    Headline("cpu", "recompute-reclaim/plain", ("peak_bytes", "end_of_backward_bytes"),
             "checkpointed stack, no aliasing"),
    Headline("cpu", "megatron-scale/moe/256x256/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=256 S=256 fp32"),
    Headline("gpu-h200", "megatron-scale/moe/1024x2048/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=1024 S=2048 fp32"),
    Headline("gpu-h200", "megatron-scale/moe/2048x4096/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=2048 S=4096 fp32"),
    Headline("gpu-h200", "megatron-scale/moe-ep2/2048x4096/fp32", ("peak_bytes", "retained_bytes"),
             "MoE GPT, H=2048 S=4096, EP=2"),
    Headline("gpu-h200", "recompute-reclaim/chunked-mtp", ("peak_bytes", "end_of_backward_bytes"),
             "checkpointed stack, chunked MTP input"),
)
METRIC_NAMES = {"peak_bytes": "peak", "end_of_backward_bytes": "end of backward",
                "retained_bytes": "kept between steps", "after_forward_bytes": "after forward"}


@dataclass(frozen=True, slots=True)
class HeadlineRow:
    """One figure of one headline cell: each reference's row and ours, from one run."""

    cell: Headline
    metric: str
    references: list[tuple[str, Row | None]]
    subject: Row | None
    run_label: str  # "" when the cell has no committed run
    anchor_key: tuple[str, str]

    def versus(self) -> list[tuple[str, Versus | None]]:
        return [(title, versus(self.subject, ref, self.metric)) for title, ref in self.references]


def headline_rows(views: list[ScenarioView], cells=HEADLINES) -> list[HeadlineRow]:
    by_key = {(v.kind, v.scenario): v for v in views}
    rows = []
    for cell in cells:
        view = by_key.get((cell.kind, cell.scenario))
        latest = view.latest.rows if view else {}
        for metric in cell.metrics:
            rows.append(HeadlineRow(cell, metric, reference_rows(latest), latest.get(SUBJECT),
                                    view.latest.label if view else "", (cell.kind, cell.scenario)))
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


SHORT = {"no reclaim": "none", "verl 0.8.0": "0.8.0", "verl 0.9.1": "0.9.1"}
COLUMNS = ("what", "device", "figure", *(t for t, _ in REFERENCES), SUBJECT,
           *(f"{SUBJECT} / {SHORT[t]} (diff)" for t, _ in REFERENCES), "run")


def cells_of(row: HeadlineRow) -> list[str]:
    """The row's cells in ``COLUMNS`` order, as text (figures in MiB)."""
    return [row.cell.what, row.cell.kind, METRIC_NAMES.get(row.metric, row.metric),
            *(figure_text(ref, row.metric) for _, ref in row.references),
            figure_text(row.subject, row.metric),
            *("-- (crashed)" if ref is not None and ref.crashed else versus_text(v)
              for (_, v), (_, ref) in zip(row.versus(), row.references, strict=True)),
            row.run_label or "not run"]


def markdown(rows: list[HeadlineRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = cells_of(row)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def readme_block(rows: list[HeadlineRow]) -> str:
    """What goes between the README's markers: the table and how it was made."""
    return (markdown(rows) + "\n\nGenerated from the latest committed run of each scenario on "
            "each device kind (`python -m benchmarks.dashboard -o benchmarks/results/dashboard.html "
            "--readme README.md`; the cells are `benchmarks/headline.py`'s). Figures in MiB; "
            "`ours / X` is ours' figure divided by X's, the difference in MiB in brackets; `run` is "
            "the commit and date (UTC) of the run. CPU: MemTracker, `tox -e bench`; H200: CUDA peak "
            "stats, `pytest benchmarks -m gpu`. Every other figure (activation checkpointing with "
            "`mesh_preserving_context_fn`, step times, the sanitizers) and each figure's history: "
            "[`benchmarks/results/dashboard.html`](benchmarks/results/dashboard.html).\n")


def update_readme(path: str | Path, table: str) -> bool:
    """Put ``table`` between the README's markers; True if the file changed. ValueError when
    the markers are missing or out of order (nothing is written then)."""
    path = Path(path)
    text = path.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path}: no '{README_BEGIN}' ... '{README_END}' block to fill")
    new = text[:begin + len(README_BEGIN)] + "\n" + table.rstrip("\n") + "\n" + text[end:]
    if new != text:
        path.write_text(new)
    return new != text
