"""Unit tests of the dashboard builder (python -m benchmarks.dashboard) on hand-made runs."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import dashboard
from benchmarks._results import run_from_json

pytestmark = pytest.mark.cpu

MiB = 2**20


def bench(scenario, strategy, kind="cpu", **metrics):
    return {"name": strategy, "extra_info": {"scenario": scenario, "strategy": strategy,
                                             "device_kind": kind, **metrics}}


def run(commit, when, *benches):
    return run_from_json({"benchmarks": list(benches), "datetime": when,
                          "commit_info": {"id": commit, "dirty": False}})


OLD = run("1111111111", "2026-11-01T00:00:00",
          bench("reclaim/chunked", "none", peak_bytes=40 * MiB),
          bench("reclaim/chunked", "unsafe", peak_bytes=30 * MiB),
          bench("reclaim/chunked", "ours", peak_bytes=33 * MiB))
NEW = run("2222222222", "2026-11-02T00:00:00",
          bench("reclaim/chunked", "none", peak_bytes=40 * MiB),
          bench("reclaim/chunked", "ours", peak_bytes=32 * MiB, recompute_flops=2e9),
          bench("ac/llama3", "full", kind="gpu-h200", peak_bytes=1.5 * 2**30))


def test_one_section_per_device_kind_and_scenario_newest_run_is_latest():
    html = dashboard.render([NEW, OLD])  # order of the arguments does not matter
    assert re.findall(r'<h2 id="([^"]+)"', html) == ["cpu-reclaim-chunked", "gpu-h200-ac-llama3"]
    assert "latest <b>22222222</b>" in html
    assert "latest run (22222222)" in html


def test_latest_and_history_are_per_device_kind():
    gpu_only = run("3333333333", "2026-11-03T00:00:00",
                   bench("reclaim/chunked", "ours", kind="gpu-h200", peak_bytes=90 * MiB))
    html = dashboard.render([OLD, NEW, gpu_only])
    cpu = html.split('<h2 id="cpu-reclaim-chunked"')[1].split("<h2")[0]
    assert "not in the latest run" not in cpu and "latest run (22222222)" in cpu
    assert "history over 2 run(s)" in cpu and "33333333" not in cpu
    gpu = html.split('<h2 id="gpu-h200-reclaim-chunked"')[1].split("<h2")[0]
    assert "latest run (33333333)" in gpu


def test_unknown_commit_is_labelled_by_file_name(tmp_path):
    path = tmp_path / "gpu-h200-abc.json"
    path.write_text(json.dumps({"benchmarks": [bench("s", "x", peak_bytes=1)],
                                "datetime": "2026-11-03T00:00:00",
                                "commit_info": {"id": "unknown", "dirty": False}}))
    assert dashboard.load_run(str(path)).label == "gpu-h200-abc"


def test_strategies_side_by_side_with_na_for_a_strategy_the_latest_run_lacks():
    html = dashboard.render([OLD, NEW])
    section = html.split('<h2 id="cpu-reclaim-chunked"')[1].split("<h2")[0]
    peak_card = section.split("peak memory")[1].split('class="card"')[0]
    bars_svg = peak_card.split("<svg")[1]
    labels = re.findall(r'text-anchor="end" fill="#222">([^<]+)</text>', bars_svg)
    assert labels == ["none", "unsafe", "ours"]
    assert ">n/a</text>" in bars_svg  # unsafe is not in the latest run
    assert "ours: 32.00 MiB" in bars_svg and "none: 40.00 MiB" in bars_svg


def test_history_draws_one_point_per_run_and_strategy():
    html = dashboard.render([OLD, NEW])
    section = html.split('<h2 id="cpu-reclaim-chunked"')[1].split("<h2")[0]
    history = section.split("peak memory")[1].split("history over 2 run(s)")[1]
    points = re.findall(r"<title>([^<]+)</title></circle>", history)
    assert points == ["none @ 11111111: 40.00 MiB", "none @ 22222222: 40.00 MiB",
                      "unsafe @ 11111111: 30.00 MiB",
                      "ours @ 11111111: 33.00 MiB", "ours @ 22222222: 32.00 MiB"]
    assert "one run so far" in dashboard.render([NEW])


def test_page_is_self_contained():
    html = dashboard.render([OLD, NEW])
    assert "<script" not in html.lower()
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert html.count("<svg") == html.count("</svg>") > 0


def test_cli_writes_the_page_and_reports_bad_input(tmp_path, capsys):
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"benchmarks": [bench("s", "a", peak_bytes=1)]}))
    out = tmp_path / "d.html"
    assert dashboard.main([str(good), "-o", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert dashboard.main([str(bad), "-o", str(out)]) == 2
    assert "not pytest-benchmark JSON" in capsys.readouterr().err


def test_render_needs_a_run():
    with pytest.raises(ValueError, match="at least one run"):
        dashboard.render([])


def test_a_strategy_of_the_scenario_family_missing_in_a_variant_is_na():
    html = dashboard.render([run("3333333333", "2026-11-03T00:00:00",
                                 bench("reclaim/plain", "unsafe", peak_bytes=30 * MiB),
                                 bench("reclaim/plain", "ours", peak_bytes=30 * MiB),
                                 bench("reclaim/chunked", "ours", peak_bytes=31 * MiB))])
    chunked = html.split('<h2 id="cpu-reclaim-chunked"')[1].split("<h2")[0]
    assert "<tr><td>unsafe</td><td>n/a<br>" in chunked
    assert ">n/a</text>" in chunked.split("<svg")[1]


def test_latest_figures_show_their_change_against_previous_run_and_baseline():
    base = run("0000000000", "2026-10-01T00:00:00",
               bench("reclaim/chunked", "ours", peak_bytes=40 * MiB),
               bench("reclaim/chunked", "none", peak_bytes=40 * MiB))
    html = dashboard.render([OLD, NEW], baselines={"cpu": base})
    table = html[html.index('id="cpu-reclaim-chunked"'):html.index("</table>")]
    rows = {r.split("</td>")[0]: r for r in table.split("<tr><td>")[1:]}
    # ours: 32 MiB now, 33 MiB in the previous run, 40 MiB in the baseline
    assert "prev -3.03% · base -20.00%" in rows["ours"]
    assert "prev +0.00% · base +0.00%" in rows["none"]
    # unsafe is not in the latest run: n/a, no delta to show
    assert "n/a" in rows["unsafe"] and "prev - · base -" in rows["unsafe"]


def test_cli_compares_with_the_baseline_of_each_device_kind(tmp_path):
    base_dir = tmp_path / "baselines"
    base_dir.mkdir()
    (base_dir / "cpu.json").write_text(json.dumps({"benchmarks": [
        bench("reclaim/chunked", "ours", peak_bytes=16 * MiB)], "datetime": "2026-10-01T00:00:00"}))
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"benchmarks": [bench("reclaim/chunked", "ours",
                                                       peak_bytes=32 * MiB)]}))
    out = tmp_path / "d.html"
    assert dashboard.main([str(result), "-o", str(out), "--baselines", str(base_dir)]) == 0
    assert "base +100.00%" in out.read_text()
