"""README.md's figure table is generated from the committed runs (``python -m benchmarks.headline
--readme README.md``, also run by ``python -m benchmarks.gate RESULTS.json --refresh``): the
committed README holds exactly what the generator gives today, and the generator touches
nothing outside its markers."""

from __future__ import annotations

import pytest

from benchmarks import headline

pytestmark = pytest.mark.cpu


def test_the_readmes_figure_table_is_what_the_committed_runs_give(capsys):
    assert headline.main(["--check"]) == 0, capsys.readouterr().err


def readme(tmp_path, block="stale table"):
    path = tmp_path / "README.md"
    path.write_text(f"# title\nprose\n{headline.README_BEGIN}\n{block}\n{headline.README_END}\nmore\n")
    return path


def test_check_fails_and_writes_nothing_when_the_block_differs(tmp_path, capsys):
    path = readme(tmp_path)
    before = path.read_text()
    assert headline.main(["--readme", str(path), "--check"]) == 1
    assert "regenerate it: python -m benchmarks.headline --readme" in capsys.readouterr().err
    assert path.read_text() == before


def test_the_generator_rewrites_only_its_block(tmp_path):
    path = readme(tmp_path)
    assert headline.main(["--readme", str(path)]) == 0
    text = path.read_text()
    assert text.startswith(f"# title\nprose\n{headline.README_BEGIN}\n| MiB peak / kept |")
    assert text.endswith(f"{headline.README_END}\nmore\n") and "stale table" not in text
    assert headline.main(["--readme", str(path), "--check"]) == 0


def test_a_readme_without_markers_is_an_error(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text("no markers\n")
    assert headline.main(["--readme", str(path), "--check"]) == 2
    assert "no '<!-- headline:begin" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["cpu", "gpu-h200", "gpu-h100-80gb-hbm3"])
def test_the_committed_baseline_matches_the_published_figures(kind):
    """The baseline the gate compares with and the figures the README and the dashboard show
    (the latest committed run of each scenario) are the same figures: a baseline refreshed
    without filing its run, or a run filed without refreshing, fails here."""
    from benchmarks._baseline import baseline_path_for
    from benchmarks._published import published_rows, published_runs
    from benchmarks._results import load_run
    from benchmarks._verdict import Verdict, compare

    shown = published_rows(published_runs(), [kind])
    differ = [f"{c.scenario} [{c.strategy}] {c.metric}: published {c.now}, baseline {c.baseline}"
              for c in compare(shown, load_run(baseline_path_for(kind)).rows)
              if c.verdict not in (Verdict.OK, Verdict.INFO)]
    assert not differ, "\n".join(differ)


class _History:
    """A git history in which ``changed_after`` names the newest commit touching the paths."""

    def __init__(self, changed_after: str):
        self.changed_after = changed_after

    def head(self):
        return "f" * 40

    def has(self, commit):
        return True

    def last_change(self, since, paths):
        return self.changed_after

    def differs(self, since, paths):  # the content changed wherever a commit touched it
        return bool(self.last_change(since, paths))


@pytest.mark.parametrize("changed_after", ["", "c" * 40])
def test_the_compat_line_says_when_the_matrix_is_older_than_the_code(tmp_path, changed_after):
    import json

    from repro.compat.render import README_BEGIN, README_END

    matrix = json.loads(headline.COMPAT_MATRIX.read_text())
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(matrix))
    text = f"intro\n{README_BEGIN}\nold line\n{README_END}\ntail\n"
    new = headline.with_compat_summary(text, path, history=_History(changed_after))
    assert new.startswith(f"intro\n{README_BEGIN}\nThe committed matrix describes commit")
    assert new.endswith(f"{README_END}\ntail\n") and "old line" not in new
    older = "**Older than the code:** fixes/, repro/ changed after it" in new
    assert older is bool(changed_after)
    assert ("tox -m compat" in new) is bool(changed_after)


class _OneOldCommit(_History):
    """A history in which the code changed after ``old`` only."""

    def __init__(self, old: str):
        self.old = old

    def last_change(self, since, paths):
        return "c" * 40 if since == self.old else ""


def test_a_merged_matrix_is_as_old_as_its_oldest_combination(tmp_path):
    """A matrix whose newest run is current but one combination ran before the code changed is
    older than the code (the merged matrix's own commit is its newest run's)."""
    import json

    from repro.compat.render import README_BEGIN, README_END

    matrix = json.loads(headline.COMPAT_MATRIX.read_text())
    combos = matrix["combinations"]
    assert len(combos) >= 2
    for c in combos:
        c["commit"] = "b" * 8
    combos[0]["commit"] = "a" * 8
    matrix["commit"] = "b" * 8
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(matrix))
    text = f"{README_BEGIN}\nold line\n{README_END}\n"
    assert "**Older than the code:**" in headline.with_compat_summary(
        text, path, history=_OneOldCommit("a" * 8))
    assert "**Older than the code:**" not in headline.with_compat_summary(
        text, path, history=_OneOldCommit("d" * 8))
