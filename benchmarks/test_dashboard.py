"""Unit tests of the dashboard builder (python -m benchmarks.dashboard) and the headline table,
on hand-made runs."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import _svg, _views, dashboard, headline
from benchmarks._results import run_from_json

pytestmark = pytest.mark.cpu

MiB = 2**20
SCN = "recompute-reclaim/chunked-mtp"


def bench(scenario, strategy, kind="cpu", env=None, **metrics):
    return {"name": strategy, "extra_info": {"scenario": scenario, "strategy": strategy,
                                             "device_kind": kind, **(env or {}), **metrics}}


def run(commit, when, *benches, dirty=False, path=""):
    return run_from_json({"benchmarks": list(benches), "datetime": when,
                          "commit_info": {"id": commit, "dirty": dirty}}, path=path)


def section(html, kind, scenario):
    return html.split(f'id="{dashboard.anchor(kind, scenario)}"')[1].split("</details>")[0]


OLD = run("1111111111", "2026-11-01T00:00:00",
          bench(SCN, "none", peak_bytes=40 * MiB),
          bench(SCN, "mtp-skip", peak_bytes=34 * MiB),
          bench(SCN, "ours", peak_bytes=33 * MiB))
NEW = run("2222222222", "2026-11-02T00:00:00",
          bench(SCN, "none", peak_bytes=40 * MiB),
          bench(SCN, "unsafe", crashed="SIGSEGV"),
          bench(SCN, "mtp-skip", peak_bytes=34 * MiB),
          bench(SCN, "ours", peak_bytes=32 * MiB))
GPU = run("3333333333", "2026-11-03T00:00:00",
          bench("megatron-scale/moe/2048x4096/fp32", "none", kind="gpu-h200", peak_bytes=8000 * MiB),
          bench("megatron-scale/moe/2048x4096/fp32", "verl-0.8.0", kind="gpu-h200", peak_bytes=7840 * MiB),
          bench("megatron-scale/moe/2048x4096/fp32", "ours", kind="gpu-h200", peak_bytes=7840 * MiB))


def test_each_section_shows_the_latest_run_of_its_own_scenario_and_kind():
    html = dashboard.render([GPU, NEW, OLD])  # a newer GPU run of another scenario
    assert re.findall(r'<details class="scn" id="([^"]+)"', html) == [
        "cpu-recompute-reclaim-chunked-mtp", "gpu-h200-megatron-scale-moe-2048x4096-fp32"]
    cpu = section(html, "cpu", SCN)
    assert "latest 22222222 11-02 00:00" in cpu and "previous: 11111111 11-01 00:00" in cpu
    assert "33333333" not in cpu
    assert "not in the latest run" not in html


def test_dirty_runs_are_left_out_unless_asked_and_then_marked():
    dirty = run("4444444444", "2026-11-04T00:00:00", bench(SCN, "ours", peak_bytes=1 * MiB),
                dirty=True)
    html = dashboard.render([OLD, NEW, dirty])
    assert "44444444" not in html and "1 run(s) of a dirty tree left out" in html
    marked = dashboard.render([OLD, NEW, dirty], include_dirty=True)
    assert "latest 44444444+dirty" in section(marked, "cpu", SCN)
    assert 'class="dirty">dirty tree' in section(marked, "cpu", SCN)
    with pytest.raises(ValueError, match="dirty tree"):
        dashboard.render([dirty])


def test_a_run_without_a_commit_is_labelled_by_its_date(tmp_path):
    path = tmp_path / "gpu-h200-abc.json"
    path.write_text(json.dumps({"benchmarks": [bench("s", "x", peak_bytes=1)],
                                "datetime": "2026-11-03T10:18:00",
                                "commit_info": {"id": "unknown", "dirty": False}}))
    r = dashboard.load_run(str(path))
    assert r.label == "gpu-h200-abc" and _views.short_label(r) == "commit? 11-03 10:18"


def test_every_strategy_against_no_reclaim_and_each_verl_release():
    cpu = section(dashboard.render([OLD, NEW]), "cpu", SCN)
    table = cpu.split("<table>")[1].split("</table>")[0]
    assert re.findall(r"<th>(vs [^<]+)</th>", table) == [
        "vs no reclaim", "vs verl 0.8.0", "vs verl 0.9.1", "vs previous run", "vs baseline"]
    ours = table.split("ours</span></td>")[1].split("</tr>")[0]
    # 32 MiB: 0.800 of none (-8 MiB), verl 0.8.0 crashed (no ratio), 0.941 of mtp-skip (-2 MiB)
    assert re.findall(r'class="good">([\d.]+)</span> <span class="note">([^<]+)<', ours) == [
        ("0.800", "-8.00 MiB"), ("0.941", "-2.00 MiB")]
    assert "-3.03%" in ours  # 33 -> 32 MiB since the previous run


def test_a_crashed_strategy_shows_as_crashed_with_its_error():
    cpu = section(dashboard.render([OLD, NEW]), "cpu", SCN)
    assert '<span class="crashed">crashed (SIGSEGV)</span>' in cpu
    rows = headline.headline_rows(_views.scenario_views([NEW]))
    verl = next(r for r in rows if r.title == "verl 0.8.0")
    assert headline.cells_of(verl)[2:5] == ["verl 0.8.0", "crashed (SIGSEGV)", "-- (crashed)"]


def test_the_section_summary_gives_ours_against_no_reclaim_and_the_previous_run():
    cpu = section(dashboard.render([OLD, NEW]), "cpu", SCN)
    summary = cpu.split("</summary>")[0]
    assert "ours / no reclaim, peak: " in summary and ">0.800</span>" in summary
    assert "vs previous run -3.03%" in summary


def test_a_sections_first_run_says_so_and_names_strategies_as_the_headline_does():
    cpu = section(dashboard.render([NEW]), "cpu", SCN)
    summary = cpu.split("</summary>")[0]
    assert "the first committed run of this scenario" in summary and "vs previous run" not in summary
    table = cpu.split("<table>")[1].split("</table>")[0]
    keys = re.findall(r'<span class="key"><i [^>]*></i>([^<]+)</span>', table)
    assert keys == ["no reclaim", "verl 0.8.0", "verl 0.9.1", "ours"], keys
    names = dashboard.render([NEW]).split('class="names"')[1].split("</table>")[0]
    assert "verl 0.8.0 (unsafe)" in names and "verl 0.9.1 (mtp-skip)" in names


def test_change_against_the_baseline():
    base = run("0000000000", "2026-10-01T00:00:00", bench(SCN, "ours", peak_bytes=40 * MiB))
    html = dashboard.render([OLD, NEW], baselines={"cpu": base})
    ours = section(html, "cpu", SCN).split("ours</span></td>")[1].split("</tr>")[0]
    assert "<td>-20.00%</td>" in ours


def test_history_labels_are_distinct_and_environment_changes_are_noted():
    a = run("5555555555", "2026-11-05T09:00:00",
            bench(SCN, "ours", env={"torch_version": "2.13.0"}, peak_bytes=32 * MiB))
    b = run("5555555555", "2026-11-05T10:00:00",
            bench(SCN, "ours", env={"torch_version": "2.15.0"}, peak_bytes=32.32 * MiB))
    view = _views.scenario_views([a, b])[0]
    assert [p.label for p in view.history] == ["55555555 11-05 09:00", "55555555 11-05 10:00"]
    assert view.env_changes == [(1, "torch 2.13.0 -> 2.15.0")]
    html = section(dashboard.render([a, b]), "cpu", SCN)
    assert "environment changed at 55555555 11-05 10:00: torch 2.13.0 -&gt; 2.15.0" in html
    assert "<title>environment changed: torch 2.13.0 -&gt; 2.15.0</title>" in html
    ticks = re.findall(r'text-anchor="end" fill="#666">([^<]+)</text>', html)
    assert len(ticks) == len(set(ticks)) >= 3


def test_the_y_axis_shows_a_one_percent_change():
    lo, hi = _svg.y_range([100.0, 101.0])
    assert 1.0 / (hi - lo) >= 0.4
    lo, hi = _svg.y_range([100.0, 100.0])  # flat: still a scale a 1% move would show on
    assert hi - lo == pytest.approx(2.4)
    values, decimals = _svg.nice_ticks(7787.7, 7947.7)
    assert len({f"{v:.{decimals}f}" for v in values}) == len(values) >= 3


def test_page_is_self_contained():
    html = dashboard.render([OLD, NEW, GPU])
    assert "<script" not in html.lower()
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert html.count("<svg") == html.count("</svg>") > 0


def test_headline_table_reads_the_committed_runs_and_says_not_run_without_one():
    rows = headline.headline_rows(_views.scenario_views([GPU]))
    cells = {(r.kind, r.cell.scenario, r.title): headline.cells_of(r) for r in rows}
    gpu = {title: c for (kind, scn, title), c in cells.items()
           if (kind, scn) == ("gpu-h200", "megatron-scale/moe/2048x4096/fp32")}
    # one row per strategy, the rival fixes among them; ours against each, peak first
    assert list(gpu) == ["no reclaim", "verl 0.8.0", "verl 0.9.1", "Megatron-LM #6339",
                         "miles #2862 gc.collect", "ours"]
    assert gpu["no reclaim"][3:5] == ["8000.0", "0.980 (-160.00)"]
    assert gpu["verl 0.8.0"][3:5] == ["7840.0", "1.000 (±0)"]
    assert gpu["verl 0.9.1"][3:5] == gpu["Megatron-LM #6339"][3:5] == ["not run", "--"]
    assert gpu["ours"][2:5] == ["ours", "7840.0", ""]
    assert gpu["no reclaim"][:2] == ["MoE GPT, H=2048 S=4096 fp32", "gpu-h200"]
    assert gpu["no reclaim"][-1] == "33333333 11-03 00:00"
    assert gpu["ours"][:2] == ["", ""] and gpu["ours"][-1] == ""  # named on the first row only
    assert cells[("cpu", SCN, "no reclaim")][-1] == "not run"
    assert ("cpu", SCN, "Megatron-LM #6339") not in cells  # rivals: megatron-scale cells only


H100 = "gpu-h100-80gb-hbm3"
EP2 = "megatron-scale/moe-ep2/2048x4096/fp32"


def test_a_newer_run_on_another_gpu_card_supersedes_the_older_cards_section():
    """The GPU headline cells read the newest run of their scenario on any card, naming the
    card; on the page a scenario's section on another card, older, is drawn apart as
    superseded (it names the section that replaces it), and a scenario only that card ran
    (EP=2: two GPUs) stays where it was."""
    scn = "megatron-scale/moe/2048x4096/fp32"
    ep2 = run("4444444444", "2026-11-04T00:00:00",
              bench(EP2, "none", kind="gpu-h200", peak_bytes=7000 * MiB),
              bench(EP2, "ours", kind="gpu-h200", peak_bytes=6800 * MiB))
    h100 = run("6666666666", "2026-11-06T00:00:00",
               bench(scn, "none", kind=H100, peak_bytes=8001 * MiB),
               bench(scn, "ours", kind=H100, peak_bytes=7841 * MiB))
    views = _views.scenario_views([GPU, ep2, h100])
    assert _views.superseded(views) == {("gpu-h200", scn): (H100, "66666666 11-06 00:00")}
    rows = {(r.cell.scenario, r.title): r for r in headline.headline_rows(views)}
    assert rows[(scn, "no reclaim")].kind == H100
    assert headline.cells_of(rows[(scn, "no reclaim")])[1:4] == [H100, "no reclaim", "8001.0"]
    assert headline.cells_of(rows[(scn, "no reclaim")])[-1] == "66666666 11-06 00:00"
    assert rows[(EP2, "no reclaim")].kind == "gpu-h200"
    md = headline.readme_markdown(list(rows.values()))
    assert f"| MoE GPT, H=2048 S=4096 fp32 ({H100}) | 8001.0 / -- |" in md
    assert "| MoE GPT, H=2048 S=4096, EP=2 (gpu-h200) | 7000.0 / -- |" in md
    html = dashboard.render([GPU, ep2, h100])
    ids = re.findall(r'<details class="scn" id="([^"]+)"', html)
    assert ids == ["gpu-h100-80gb-hbm3-megatron-scale-moe-2048x4096-fp32",
                   "gpu-h200-megatron-scale-moe-ep2-2048x4096-fp32",
                   "gpu-h200-megatron-scale-moe-2048x4096-fp32"]  # superseded: last
    old = re.sub(r"<[^>]+>", "", section(html, "gpu-h200", scn))
    assert (f"superseded by the newer run of this scenario on {H100} "
            f"(66666666 11-06 00:00)") in old
    assert html.index('id="superseded"') < html.index(f'id="{dashboard.anchor("gpu-h200", scn)}"')
    assert "superseded" not in section(html, "gpu-h200", EP2)


def test_two_cards_runs_of_one_time_supersede_neither():
    scn = "megatron-scale/moe/2048x4096/fp32"
    h100 = run("6666666666", "2026-11-03T00:00:00",
               bench(scn, "none", kind=H100, peak_bytes=8001 * MiB))
    assert _views.superseded(_views.scenario_views([GPU, h100])) == {}


def test_a_rival_fix_shows_as_its_own_row_against_ours():
    scn = "megatron-scale/moe/2048x4096/fp32"
    rivals = run("4444444444", "2026-11-04T00:00:00", *(
        bench(scn, s, kind="gpu-h200", peak_bytes=p * MiB, retained_bytes=k * MiB)
        for s, p, k in (("none", 8000, 1000), ("megatron-6339", 7950, 900),
                        ("gc-collect", 8000, 1000), ("ours", 7840, 800))))
    rows = {r.title: headline.cells_of(r) for r in headline.headline_rows(
        _views.scenario_views([rivals])) if r.cell.scenario == scn}
    assert rows["Megatron-LM #6339"][3:7] == ["7950.0", "0.986 (-110.00)", "900.00",
                                              "0.889 (-100.00)"]
    assert rows["miles #2862 gc.collect"][5:7] == ["1000.0", "0.800 (-200.00)"]


def test_the_readmes_table_is_one_row_per_model_and_a_column_per_strategy():
    """The README's table: its cells one line each, ``peak / kept`` per strategy, a crash named,
    a strategy the family does not measure ``--``, a measured one missing from the run
    ``not run``."""
    md = headline.readme_markdown(headline.headline_rows(_views.scenario_views([NEW, GPU])))
    lines = md.splitlines()
    assert lines[0] == ("| MiB peak / kept | no reclaim | verl 0.8.0 | verl 0.9.1 | "
                        "Megatron-LM #6339 | miles #2862 gc.collect | ours | run |")
    assert len(lines) == 2 + sum(c.in_readme for c in headline.HEADLINES)
    assert ("| checkpointed stack, chunked MTP input (cpu) | 40.00 / -- | crashed (SIGSEGV) | "
            "34.00 / -- | -- | -- | 32.00 / -- | 22222222 11-02 00:00 |") in lines
    assert ("| MoE GPT, H=2048 S=4096 fp32 (gpu-h200) | 8000.0 / -- | 7840.0 / -- | not run | "
            "not run | not run | 7840.0 / -- | 33333333 11-03 00:00 |") in lines


def test_every_figure_the_readme_leaves_out_is_on_the_dashboard():
    """One size per model in the README; every headline cell in the dashboard's table, one row
    per strategy with ours against it."""
    small = "megatron-scale/moe/1024x2048/fp32"
    both = run("5555555555", "2026-11-05T00:00:00", *(
        bench(scn, s, kind="gpu-h200", peak_bytes=p * MiB, retained_bytes=k * MiB)
        for scn in (small, "megatron-scale/moe/2048x4096/fp32")
        for s, p, k in (("none", 1506, 257), ("verl-0.8.0", 1466, 193), ("ours", 1466, 192))))
    rows = headline.headline_rows(_views.scenario_views([both]))
    md = headline.readme_markdown(rows)
    assert "H=1024" not in md and "| MoE GPT, H=2048 S=4096 fp32 (gpu-h200) | 1506.0 / 257.00 |" in md
    page = dashboard.summary_table(rows)
    assert page.count("MoE GPT, H=1024 S=2048 fp32") == 1
    assert page.count("<td>1506.0</td>") == 2 and "0.973 (-40.00)" in page


def test_cli_writes_the_page_and_only_the_readme_block(tmp_path, capsys):
    result = tmp_path / "run.json"
    result.write_text(json.dumps({"benchmarks": [b for b in (
        bench("megatron-scale/moe/2048x4096/fp32", s, kind="gpu-h200", peak_bytes=v * MiB)
        for s, v in (("none", 8000), ("ours", 7840)))], "datetime": "2026-11-03T00:00:00",
        "commit_info": {"id": "3333333333", "dirty": False}}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\nhand text\n{headline.README_BEGIN}\nold table\n{headline.README_END}\ntail\n")
    out = tmp_path / "d.html"
    assert dashboard.main([str(result), "-o", str(out), "--readme", str(readme),
                           "--baselines", str(tmp_path)]) == 0
    assert out.read_text().startswith("<!doctype html>")
    text = readme.read_text()
    assert text.startswith("# top\nhand text\n") and text.endswith(f"{headline.README_END}\ntail\n")
    assert "old table" not in text and "| 8000.0 / -- |" in text
    readme.write_text("no markers\n")
    assert dashboard.main([str(result), "-o", str(out), "--readme", str(readme)]) == 2
    assert "no '<!-- headline:begin" in capsys.readouterr().err
    assert readme.read_text() == "no markers\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert dashboard.main([str(bad), "-o", str(out)]) == 2
    assert "not pytest-benchmark JSON" in capsys.readouterr().err


def test_an_open_section_that_does_not_exist_is_refused_naming_the_sections(tmp_path, capsys):
    with pytest.raises(ValueError, match="--open 'nosuch': no such section; the sections: "
                       "cpu-recompute-reclaim-chunked-mtp, gpu-h200-megatron-scale-moe-2048x4096-fp32"):
        dashboard.render([GPU, NEW], open_sections=("nosuch",))
    result = tmp_path / "run.json"
    result.write_text(json.dumps({"benchmarks": [bench(SCN, "ours", peak_bytes=MiB)],
                                  "datetime": "2026-11-03T00:00:00",
                                  "commit_info": {"id": "3333333333", "dirty": False}}))
    out = tmp_path / "d.html"
    assert dashboard.main([str(result), "-o", str(out), "--open", "nosuch"]) == 2
    assert "dashboard: --open 'nosuch': no such section" in capsys.readouterr().err
    assert not out.exists()


def test_render_needs_a_run():
    with pytest.raises(ValueError, match="at least one run"):
        dashboard.render([])


def test_without_files_the_cli_reads_the_committed_results():
    files = dashboard.committed_result_files()
    assert files and all(f.parent == dashboard.RESULTS_DIR and f.suffix == ".json" for f in files)


def test_a_move_beyond_the_tolerance_in_the_same_environment_names_the_commits():
    html = section(dashboard.render([OLD, NEW]), "cpu", SCN)  # ours 33 -> 32 MiB, same env
    assert ("at 22222222 11-02 00:00: peak_bytes moved by more than 0.5% with the same "
            "environment: the code between 11111111 and 22222222 (git log 11111111..22222222)") in html
    view = _views.scenario_views([OLD, NEW])[0]
    assert view.code_changes(0.05) == []  # 3% is within 5%


# --- step times: only with the spread of their repeats ----------------------------------------

SAN = "sanitizers/plain-transformer-full-ac"


def san_run(commit, when, ratios_by_strategy, *, repeats=True):
    import statistics

    return run(commit, when, *(
        bench(SAN, s, sanitizer_step_time_ratio=statistics.median(r),
              **({"sanitizer_step_time_ratio_repeats": r} if repeats else {}))
        for s, r in ratios_by_strategy.items()))


NOISY = {"none": [1.0] * 5, "storage-slow-path": [0.61, 0.7, 0.794, 0.9, 1.12]}


def test_a_time_ratio_whose_spread_covers_one_is_not_coloured_as_a_gain():
    html = section(dashboard.render([san_run("6666666666", "2026-11-06T00:00:00", NOISY)]), "cpu", SAN)
    summary = html.split("</summary>")[0]
    # the ratio's reference is in the figure (strategy / no sanitizer): the line names none other
    assert "storage-slow-path, sanitizer_step_time_ratio: " in summary
    assert "0.794x [0.610x-1.120x] " in summary and ", 5 repeats" in summary
    # what the ratio compares, and which side of 1 its median is on -- never "within noise"
    assert "(step time under the sanitizer(s) / without)" in summary
    assert "median below 1, but the range spans 1.0: not below it in every repeat" in summary
    assert 'class="good"' not in html and 'class="bad"' not in html and "noise" not in summary
    row = html.split("storage-slow-path</span></td>")[1].split("</tr>")[0]
    assert "[0.610x-1.120x]" in row and "the range spans 1.0" in row
    reference = html.split("no sanitizer</span></td>")[1].split("</tr>")[0]
    assert "1.000x [1.000x-1.000x]" in reference and "1 in every repeat" in reference


def test_a_time_ratio_on_one_side_of_one_in_every_repeat_is_coloured():
    slower = {"none": [1.0] * 5, "storage": [1.02, 1.05, 1.06, 1.08, 1.3]}
    html = section(dashboard.render([san_run("6666666666", "2026-11-06T00:00:00", slower)]), "cpu", SAN)
    row = html.split("storage</span></td>")[1].split("</tr>")[0]
    assert '<span class="bad">1.060x</span>' in row and "above 1 in every repeat" in row


def test_a_time_ratio_without_repeats_is_not_shown_as_a_result():
    html = section(dashboard.render([san_run("6666666666", "2026-11-06T00:00:00", NOISY,
                                             repeats=False)]), "cpu", SAN)
    assert "0.794" not in html and "no repeats recorded" in html


def test_the_reference_column_is_named_after_the_family():
    ac = run("7777777777", "2026-11-07T00:00:00",
             *(bench("activation-checkpoint/plain-transformer", s, peak_bytes=v * MiB)
               for s, v in (("none", 30), ("full", 20), ("full+mesh_ctx", 20))))
    html = section(dashboard.render([ac]), "cpu", "activation-checkpoint/plain-transformer")
    heads = re.findall(r"<th>(vs [^<]+)</th>", html.split("<table>")[1].split("</table>")[0])
    assert heads[0] == "vs no checkpointing" and "vs no reclaim" not in html
    reclaim = section(dashboard.render([NEW]), "cpu", SCN)
    assert "<th>vs no reclaim</th>" in reclaim


def test_a_single_run_gets_a_chart_of_its_strategies():
    html = section(dashboard.render([NEW]), "cpu", SCN)  # one committed run of the scenario
    assert 'class="bars"' in html and html.count("<svg") >= 1
    # every strategy has a bar (or says it crashed), labelled with its name
    bars = html.split('class="bars"')[1].split("</svg>")[0]
    for s in ("no reclaim", "verl 0.9.1", "ours"):  # the headline's names
        assert f">{s}</text>" in bars
    assert ">mtp-skip</text>" not in bars and ">none</text>" not in bars
    assert "crashed (SIGSEGV)" in bars


def test_a_time_figure_the_latest_run_lacks_gets_no_empty_table():
    old = run("5555555555", "2026-11-05T00:00:00", bench(SAN, "none", step_time_min_s=0.1),
              bench(SAN, "storage", step_time_min_s=0.2))
    new = san_run("6666666666", "2026-11-06T00:00:00", NOISY)
    html = section(dashboard.render([old, new]), "cpu", SAN)
    assert "[step_time_min_s]" not in html and "[sanitizer_step_time_ratio]" in html


def test_bar_labels_have_room_for_the_longest_strategy_name():
    bars = [_svg.Bar("storage+mesh+recompute", 1.0, "#000"), _svg.Bar("none", 1.0, "#000")]
    svg = _svg.bar_chart(bars, str, lambda lo, hi: [])
    x = float(re.search(r'<text x="([\d.]+)"[^>]*text-anchor="end"[^>]*>storage\+mesh\+recompute', svg)[1])
    assert x >= 7 * len("storage+mesh+recompute")
