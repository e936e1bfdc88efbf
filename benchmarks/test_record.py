"""python -m benchmarks.record: a run is filed under its kind, date and commit; a dirty tree's
run is refused unless asked for, and then marked."""

from __future__ import annotations

import json

import pytest

from benchmarks import record

pytestmark = pytest.mark.cpu


def write(tmp_path, *, commit="ab6f670c01", dirty=False, benches=True):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({
        "benchmarks": [{"name": "t", "extra_info": {"scenario": "s", "strategy": "ours",
                                                    "device_kind": "cpu", "peak_bytes": 1}}]
        if benches else [],
        "datetime": "2026-11-30T19:42:10+00:00", "commit_info": {"id": commit, "dirty": dirty}}))
    return path


def test_a_clean_run_is_filed_by_kind_date_and_commit(tmp_path, capsys):
    src = write(tmp_path)
    assert record.main([str(src), "--results-dir", str(tmp_path / "r")]) == 0
    target = tmp_path / "r" / "cpu-20261130T1942-ab6f670c.json"
    assert target.read_text() == src.read_text()
    assert str(target) in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, why", [({"dirty": True}, "dirty tree"),
                                         ({"commit": "unknown"}, "could not name its commit")])
def test_a_run_that_belongs_to_no_commit_is_refused_unless_asked(tmp_path, capsys, kwargs, why):
    src = write(tmp_path, **kwargs)
    out = tmp_path / "r"
    assert record.main([str(src), "--results-dir", str(out)]) == 2
    assert why in capsys.readouterr().err and not out.exists()
    assert record.main([str(src), "--results-dir", str(out), "--allow-dirty"]) == 0
    (filed,) = out.iterdir()
    assert filed.name.endswith("-dirty.json") == kwargs.get("dirty", False)


def test_a_run_without_benchmarks_is_refused(tmp_path, capsys):
    assert record.main([str(write(tmp_path, benches=False)), "--results-dir", str(tmp_path),
                        "--allow-dirty"]) == 2
    assert "no benchmarks" in capsys.readouterr().err


def test_a_second_run_of_the_same_minute_and_commit_is_filed_beside_the_first(tmp_path):
    """Two runs of one commit that start in the same minute (two pytest sessions of one GPU
    call) had one name: the second overwrote the first. Filing the same run again is a no-op."""
    first = write(tmp_path)
    second = tmp_path / "second.json"
    data = json.loads(first.read_text())
    data["benchmarks"][0]["name"] = "other"
    second.write_text(json.dumps(data))
    out = tmp_path / "r"
    for src in (first, second, first):
        assert record.main([str(src), "--results-dir", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cpu-20261130T1942-ab6f670c-2.json", "cpu-20261130T1942-ab6f670c.json"]
    assert (out / names[1]).read_text() == first.read_text()
    assert (out / names[0]).read_text() == second.read_text()
