"""Headless Chromium for the dashboard: a screenshot of the page, and a check of what a reader
sees in it (layout, visibility), with no library between us and the browser.

Contract:
- ``find_chromium()``: ``$STACKFIX_CHROMIUM``, else the first of ``CANDIDATES`` on ``PATH``,
  else None (``.ci/run`` installs Debian's ``chromium``).
- ``screenshot(page, png)``: Chromium's own ``--screenshot`` of the file at a width, the window
  as tall as the page (measured first by ``visible_check``), so nothing is cut.
- ``visible_check(page)``: loads a copy of the page with ``CHECK_SCRIPT`` appended (the page
  itself has no script), lets Chromium lay it out at ``width`` x ``height``, and returns what the
  script measured, read back from ``--dump-dom``: the headline table's rows and whether it is
  visible, each scenario section's summary delta text and whether it is visible, the sections
  that say "not in the latest run", and the page's scroll width and height.
Every run gets a fresh ``--user-data-dir`` and the flags of ``HEADLESS_FLAGS`` (no sandbox, GPU,
network services or first-run UI: containers and CI runners have none of them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# Chromium's largest window: a taller page is cut there (``screenshot`` returns the height taken)
MAX_HEIGHT = 16384
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
HEADLESS_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars")
RESULT_ID = "stackfix-browser-check"
CHECK_SCRIPT = """
<script>
(function () {
  function shown(el) {
    if (!el) return false;
    const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== "hidden" && s.display !== "none";
  }
  const table = document.getElementById("headline");
  const sections = Array.from(document.querySelectorAll("details.scn")).map(function (d) {
    const delta = d.querySelector("summary .delta");
    return {id: d.id, delta: delta ? delta.textContent.trim() : "", delta_visible: shown(delta),
            not_in_latest: d.textContent.indexOf("not in the latest run") >= 0};
  });
  const out = document.createElement("pre");
  out.id = "RESULT_ID";
  out.textContent = JSON.stringify({
    headline_visible: shown(table),
    headline_rows: table ? Array.from(table.rows).slice(1).map(function (r) {
      return Array.from(r.cells).map(function (c) { return c.textContent.trim(); }); }) : [],
    headline_right: table ? table.getBoundingClientRect().right : null,
    sections: sections,
    scroll_width: document.documentElement.scrollWidth,
    scroll_height: document.documentElement.scrollHeight,
    viewport_width: window.innerWidth,
  });
  document.body.appendChild(out);
})();
</script>
""".replace("RESULT_ID", RESULT_ID)


def find_chromium() -> str | None:
    env = os.environ.get("STACKFIX_CHROMIUM")
    if env:
        return env
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def _run(chromium: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="stackfix-chromium-") as profile:
        return subprocess.run([chromium, *HEADLESS_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)


def screenshot(page: Path, png: Path, *, chromium: str, width: int = 1280,
               height: int | None = None, timeout: float = 120) -> int:
    """Write ``png``: ``page`` at ``width`` px, as tall as the page laid out at that width
    (``height`` px if given), up to ``MAX_HEIGHT``; returns the height. RuntimeError with
    Chromium's stderr if no image came out."""
    if height is None:
        height = min(int(visible_check(page, chromium=chromium, width=width,
                                       timeout=timeout)["scroll_height"]), MAX_HEIGHT)
    png = Path(png).resolve()
    proc = _run(chromium, [f"--window-size={width},{height}", f"--screenshot={png}",
                           Path(page).resolve().as_uri()], timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return height


def visible_check(page: Path, *, chromium: str, width: int = 1280, height: int = 900,
                  timeout: float = 120) -> dict:
    """What ``CHECK_SCRIPT`` measured in ``page`` laid out at ``width`` x ``height``."""
    html = Path(page).read_text()
    with tempfile.TemporaryDirectory(prefix="stackfix-check-") as tmp:
        probe = Path(tmp) / "page.html"
        probe.write_text(html.replace("</body>", CHECK_SCRIPT + "</body>"))
        proc = _run(chromium, [f"--window-size={width},{height}", "--virtual-time-budget=5000",
                               "--dump-dom", probe.as_uri()], timeout)
    start = proc.stdout.find(f'<pre id="{RESULT_ID}">')
    if start < 0:
        raise RuntimeError(f"chromium ran no check (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    text = proc.stdout[start:].split(">", 1)[1].split("</pre>", 1)[0]
    from html import unescape

    return json.loads(unescape(text))
