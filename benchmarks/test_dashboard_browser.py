"""The dashboard in a real browser: built from fixture results by its CLI, opened in headless
Chromium at 1280 px, it shows the headline table and every scenario's delta, and no section that
has a run says "not in the latest run". ``.ci/run`` installs Chromium, so CI runs this; where no
Chromium is installed it skips, saying so."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import _browser, dashboard

pytestmark = pytest.mark.cpu

MiB = 2**20
CHROMIUM = _browser.find_chromium()
# .ci/run installs Chromium and sets this: there a missing browser fails instead of skipping.
REQUIRED = os.environ.get("STACKFIX_REQUIRE_BROWSER") == "1"
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED, reason=f"no Chromium here (looked for $STACKFIX_CHROMIUM "
    f"and {', '.join(_browser.CANDIDATES)} on PATH); .ci/run installs it")


@pytest.fixture(autouse=True)
def _browser_required():
    if CHROMIUM is None and REQUIRED:
        pytest.fail("STACKFIX_REQUIRE_BROWSER=1 but no Chromium found")


def results(commit, when, rows, *, dirty=False):
    """pytest-benchmark JSON of one run: rows are (kind, scenario, strategy, figures)."""
    return {"datetime": when, "commit_info": {"id": commit, "dirty": dirty},
            "machine_info": {"python_version": "3.11.7"},
            "benchmarks": [{"name": f"{scenario}[{strategy}]", "extra_info": {
                "scenario": scenario, "strategy": strategy, "device_kind": kind,
                "torch_version": "2.13.0+cpu" if kind == "cpu" else "2.11.0+cu130", **figures}}
                for kind, scenario, strategy, figures in rows]}


def reclaim(kind, scenario, ours_peak, *, crashed=False):
    rows = [(kind, scenario, "none", {"peak_bytes": 40 * MiB, "end_of_backward_bytes": 30 * MiB}),
            (kind, scenario, "mtp-skip", {"peak_bytes": 34 * MiB, "end_of_backward_bytes": 26 * MiB}),
            (kind, scenario, "ours", {"peak_bytes": ours_peak, "end_of_backward_bytes": 24 * MiB})]
    if crashed:
        rows.insert(1, (kind, scenario, "unsafe", {"crashed": "SIGSEGV"}))
    return rows


def scale(peak_none, peak_ours):
    s = "megatron-scale/moe/2048x4096/fp32"
    return [("gpu-h200", s, "none", {"peak_bytes": peak_none, "retained_bytes": 1153 * MiB}),
            ("gpu-h200", s, "verl-0.8.0", {"peak_bytes": peak_ours, "retained_bytes": 897 * MiB}),
            ("gpu-h200", s, "ours", {"peak_bytes": peak_ours, "retained_bytes": 897 * MiB})]


@pytest.fixture
def page(tmp_path):
    runs = {
        "cpu-1.json": results("a" * 40, "2026-11-29T10:00:00", reclaim("cpu", "recompute-reclaim/chunked-mtp", 33 * MiB)),
        "cpu-2.json": results("b" * 40, "2026-11-30T10:00:00",
                              reclaim("cpu", "recompute-reclaim/chunked-mtp", 32 * MiB, crashed=True)
                              + reclaim("cpu", "recompute-reclaim/plain", 25 * MiB)),
        # newer, but of one GPU scenario only: the CPU sections keep their own latest run
        "gpu-1.json": results("c" * 40, "2026-12-01T10:00:00", scale(7947 * MiB, 7787 * MiB)),
        # a dirty tree's run: left out by default
        "gpu-2.json": results("d" * 40, "2026-12-01T11:00:00", scale(1 * MiB, 1 * MiB), dirty=True),
    }
    for name, data in runs.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = tmp_path / "dashboard.html"
    assert dashboard.main([*(str(tmp_path / n) for n in runs), "-o", str(out),
                           "--baselines", str(tmp_path)]) == 0
    return out


@needs_chromium
def test_headline_table_and_every_delta_are_visible_at_1280px(page):
    seen = _browser.visible_check(page, chromium=CHROMIUM, width=1280)
    assert seen["headline_visible"]
    rows, what, device = {}, "", ""
    for r in seen["headline_rows"]:  # a cell (what, device) is named on its first row only
        what, device = r[0] or what, r[1] or device
        rows[(what, device, r[2])] = r
    gpu = ("MoE GPT, H=2048 S=4096 fp32", "gpu-h200")
    assert [rows[(*gpu, s)][3] for s in ("no reclaim", "verl 0.8.0", "verl 0.9.1", "ours")] == [
        "7947.0", "7787.0", "not run", "7787.0"]
    chunked = ("checkpointed stack, chunked MTP input", "cpu", "verl 0.8.0")
    assert rows[chunked][3] == "crashed (SIGSEGV)", rows
    assert seen["headline_right"] <= 1280 and seen["scroll_width"] <= seen["viewport_width"]
    sections = {s["id"]: s for s in seen["sections"]}
    assert sorted(sections) == ["cpu-recompute-reclaim-chunked-mtp", "cpu-recompute-reclaim-plain",
                                "gpu-h200-megatron-scale-moe-2048x4096-fp32"]
    for s in sections.values():
        assert s["delta_visible"] and s["delta"].startswith("ours / no reclaim"), s
        assert not s["not_in_latest"], s
    assert "vs previous run -3.03%" in sections["cpu-recompute-reclaim-chunked-mtp"]["delta"]
    assert "0.980" in sections["gpu-h200-megatron-scale-moe-2048x4096-fp32"]["delta"]


@needs_chromium
def test_a_screenshot_of_the_page(page, tmp_path):
    png = tmp_path / "page.png"
    _browser.screenshot(page, png, chromium=CHROMIUM, width=1280, height=900)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@needs_chromium
def test_the_screenshot_is_as_tall_as_the_page(tmp_path):
    """Not a fixed window that cuts the page: the screenshot is the page's own height."""
    tall = tmp_path / "tall.html"
    tall.write_text('<!doctype html><html><body style="margin:0">'
                    '<div style="height:3100px;background:#eee"></div></body></html>')
    png = tmp_path / "tall.png"
    _browser.screenshot(tall, png, chromium=CHROMIUM, width=1280)
    assert png_size(png) == (1280, 3100)


@needs_chromium
def test_the_dashboards_screenshot_shows_all_of_it(page, tmp_path):
    seen = _browser.visible_check(page, chromium=CHROMIUM, width=1280)
    png = tmp_path / "page.png"
    assert dashboard.main([str(p) for p in sorted(page.parent.glob("*.json"))]
                          + ["-o", str(page), "--baselines", str(tmp_path), "--screenshot", str(png)]) == 0
    assert png_size(png) == (1280, seen["scroll_height"])
