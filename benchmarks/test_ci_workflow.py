"""ci/benchmarks.yml wires the gate the way its header says: the benchmarks run, the gate's
markdown is commented on the pull request, the dashboard goes to GitHub Pages from main, and the
job fails when the gate does (a regression beyond its tolerance) or a benchmark test fails."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

WORKFLOW = Path(__file__).resolve().parent.parent / "ci" / "benchmarks.yml"


@pytest.fixture(scope="module")
def workflow():
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the workflow file")
    return yaml.safe_load(WORKFLOW.read_text())


def steps(workflow, job="benchmarks"):
    return workflow["jobs"][job]["steps"]


def step_running(workflow, text):
    found = [s for s in steps(workflow) if text in s.get("run", "") or text in s.get("uses", "")]
    assert found, f"no step runs {text!r}"
    return found[0]


def test_the_gate_verdict_is_commented_on_the_pull_request(workflow):
    assert step_running(workflow, "tox -e bench")["env"]["STACKFIX_REQUIRE_BROWSER"] == "1"
    assert "--markdown site/gate.md" in step_running(workflow, "python -m benchmarks.gate")["run"]
    comment = step_running(workflow, "gh pr comment")
    assert "pull_request" in comment["if"] and "always()" in comment["if"]
    assert workflow["jobs"]["benchmarks"]["permissions"]["pull-requests"] == "write"


def test_the_dashboard_is_published_to_pages_from_main(workflow):
    assert "python -m benchmarks.dashboard -o site/index.html" in step_running(
        workflow, "benchmarks.dashboard")["run"]
    upload = step_running(workflow, "actions/upload-pages-artifact")
    assert "refs/heads/main" in upload["if"]
    pages = workflow["jobs"]["pages"]
    assert pages["permissions"] == {"pages": "write", "id-token": "write"}
    assert [s["uses"] for s in pages["steps"]] == ["actions/deploy-pages@v4"]


def test_the_job_fails_when_the_gate_or_a_benchmark_test_fails(workflow):
    last = steps(workflow)[-1]
    assert last["if"] == "always()"
    assert 'test "${{ steps.gate.outputs.rc }}" = "0"' in last["run"]
    assert '"${{ steps.bench.outcome }}" = "success"' in last["run"]


def test_the_checkout_has_the_history_runs_are_judged_against(workflow):
    """The dashboard and the README's table say whether each run is older than the code it
    measures (``git diff RUN HEAD``): a shallow checkout would lack the runs' commits."""
    checkout = step_running(workflow, "actions/checkout")
    assert checkout.get("with", {}).get("fetch-depth") == 0
