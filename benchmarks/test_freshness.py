"""A section whose run is older than the last change to the code it measures says so: in a
temporary git repository, a run at one commit, then a change to the fix it measures, then a
change elsewhere."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import _freshness, _views, dashboard, headline
from benchmarks._results import run_from_json

pytestmark = pytest.mark.cpu

MiB = 2**20
SCN = "recompute-reclaim/chunked-mtp"


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def commit(repo, path, text, message) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    git(repo, "add", path)
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def history(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    measured = commit(repo, "fixes/megatron/reclaim.py", "v1\n", "the fix")
    fix_changed = commit(repo, "fixes/megatron/reclaim.py", "v2\n", "the fix changes")
    elsewhere = commit(repo, "fixes/sanitize/storage.py", "s\n", "another fix changes")
    return _freshness.History(repo), measured, fix_changed, elsewhere


def reclaim_run(commit_id, when="2026-11-30T10:00:00"):
    return run_from_json({"datetime": when, "commit_info": {"id": commit_id, "dirty": False},
                          "benchmarks": [{"name": s, "extra_info": {
                              "scenario": SCN, "strategy": s, "device_kind": "cpu",
                              "peak_bytes": v * MiB}} for s, v in (("none", 40), ("ours", 32))]})


def test_a_run_older_than_a_change_to_its_measured_paths_is_stale(history):
    hist, measured, fix_changed, elsewhere = history
    age = _freshness.freshness(measured, "recompute-reclaim", hist)
    assert age.age is _freshness.Age.OLDER and age.stale
    assert age.changed == ("fixes/megatron/",) and age.last_change == fix_changed
    assert age.note() == (f"run at {measured[:8]}, older than the last change to fixes/megatron/ "
                          f"at {fix_changed[:8]}")
    # a change to another fix's code does not make it stale
    current = _freshness.freshness(fix_changed, "recompute-reclaim", hist)
    assert current.age is _freshness.Age.CURRENT and not current.stale
    assert _freshness.freshness(measured, "sanitizers", hist).changed == ("fixes/sanitize/",)


def test_a_change_undone_since_the_run_leaves_it_current(history):
    """Freshness is the code's content: a measured file changed and changed back (a reverted
    commit) is the code the run measured."""
    hist, measured, fix_changed, elsewhere = history
    repo = hist.repo
    undone = commit(repo, "fixes/megatron/reclaim.py", "v1\n", "the fix change undone")
    history2 = _freshness.History(repo)
    assert _freshness.freshness(measured, "recompute-reclaim", history2).age is (
        _freshness.Age.CURRENT)
    older = _freshness.freshness(fix_changed, "recompute-reclaim", history2)
    assert older.age is _freshness.Age.OLDER and older.last_change == undone


def test_a_run_that_names_no_commit_cannot_be_tied_to_the_code(history):
    hist, *_ = history
    assert _freshness.freshness("", "recompute-reclaim", hist).age is _freshness.Age.UNKNOWN_COMMIT
    missing = _freshness.freshness("f" * 40, "recompute-reclaim", hist)
    assert missing.age is _freshness.Age.NOT_IN_HISTORY and missing.stale
    assert _freshness.freshness("", "no-such-family", hist).age is _freshness.Age.NO_PATHS


def test_the_section_and_the_headline_say_so_visibly(history):
    hist, measured, fix_changed, _ = history
    html = dashboard.render([reclaim_run(measured)], history=hist)
    section = html.split(f'id="{dashboard.anchor("cpu", SCN)}"')[1].split("</details>")[0]
    summary = section.split("</summary>")[0]
    assert '<span class="stale">older than the code</span>' in summary  # visible while collapsed
    assert (f'<p class="stale">run at {measured[:8]}, older than the last change to '
            f'fixes/megatron/ at {fix_changed[:8]}') in section
    assert f"as of {hist.head()[:8]}" in html
    rows = headline.headline_rows(_views.scenario_views([reclaim_run(measured)]), history=hist)
    assert headline.cells_of(rows[0])[-1] == (
        f"{measured[:8]} 11-30 10:00, older than the code")
    fresh = dashboard.render([reclaim_run(fix_changed)], history=hist)
    fresh_section = fresh.split(f'id="{dashboard.anchor("cpu", SCN)}"')[1].split("</details>")[0]
    assert 'class="stale"' not in fresh_section
    assert f"run at {fix_changed[:8]}: no change since to the code it measures" in fresh_section
    assert 'class="stale"' not in fresh.split('id="headline"')[1].split("</table>")[0]


def test_every_benchmark_family_declares_the_paths_it_measures():
    from benchmarks._published import published_runs

    families = {r.scenario.split("/")[0] for run in published_runs() for r in run.rows}
    families |= {"recompute-reclaim", "megatron-scale", "activation-checkpoint",
                 "backward-threads", "sanitizers", "recompute-sanitizer"}
    assert families <= set(_freshness.MEASURED_PATHS)
    root = _freshness.REPO
    for family, paths in _freshness.MEASURED_PATHS.items():
        for path in paths:
            assert (root / path).exists(), (family, path)


def test_a_run_without_a_commit_is_marked_with_one_plain_sentence(history):
    hist, *_ = history
    html = dashboard.render([reclaim_run("unknown")], history=hist)
    section = html.split(f'id="{dashboard.anchor("cpu", SCN)}"')[1].split("</details>")[0]
    assert '<span class="stale">commit unknown</span>' in section.split("</summary>")[0]
    assert ('<p class="stale">run at an unknown commit (git could not name it): its figures '
            'cannot be tied to the code.</p>') in section
