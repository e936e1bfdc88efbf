"""The benchmarks' per-cell children are forked by the fork server (repro.harness.forkserver),
not spawned: a spawned child's interpreter and imports were most of a cell's time."""

from __future__ import annotations

import json

import pytest

import repro
from repro.harness.isolated_result import IsolatedResult

pytestmark = pytest.mark.cpu


def _families():
    from benchmarks import _output_discard, _reclaim

    return {"reclaim": (_reclaim, ("plain", "ours", "cpu")),
            "output-discard": (_output_discard, (_output_discard.SCENARIOS[0],
                                                 _output_discard.STRATEGIES[0], "cpu"))}


@pytest.mark.parametrize("family", ["reclaim", "output-discard"])
def test_a_cell_child_is_forked_by_the_fork_server(monkeypatch, family):
    module, cell = _families()[family]
    asked = []

    def fake(**kwargs):
        asked.append(kwargs.get("forkserver", False))
        out = module.FIGURES_MARKER + json.dumps({"peak": 1}) + "\n"
        return IsolatedResult(returncode=0, stdout=out, stderr="", seconds=0.0, timed_out=False)

    monkeypatch.setattr(repro, "run_isolated", fake)
    assert module.figures_in_child(*cell) == {"peak": 1}
    assert asked == [True]
