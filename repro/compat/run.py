"""Run one combination: its venv (built once), then ``python -m repro --json`` inside it."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import time
from pathlib import Path

from repro.compat.combos import Combination
from repro.compat.matrix import Cell, CombinationResult, cells_from_runner
from repro.compat.venvs import (
    VERL_DIR,
    checkout_env,
    ensure_venv,
    installed_versions,
    last_error_line,
)
from repro.harness.megatron_lm import checkout_commit, megatron_lm_checkout

RUNNER_TIMEOUT = 3600.0  # every repro has its own timeout inside; this is the backstop


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")


_LISTED = re.compile(r"^(\S+)\s+\[[^\]]*\]\s(.*)$")


def repro_summaries(python: str, repo: Path) -> dict[str, str]:
    """Each repro's one-line summary, as ``python -m repro --list`` prints it in a venv."""
    done = subprocess.run([python, "-m", "repro", "--list"], cwd=repo, env=checkout_env(repo),
                          capture_output=True, text=True, timeout=600)
    return {m[1]: m[2].strip() for line in done.stdout.splitlines() if (m := _LISTED.match(line))}


def run_combination(combo: Combination, root: Path, repo: Path, *, device: str = "cpu",
                    reinstall: bool = False, uv: str | None = None,
                    log=print) -> CombinationResult:
    result = CombinationResult(combo.name, combo.python, list(combo.requirements), combo.verl,
                               date=now())
    log(f"[{combo.name}] venv under {root} ...")
    install = ensure_venv(combo, root, repo, reinstall=reinstall, uv=uv)
    result.install_seconds, result.reused_venv = round(install.seconds, 1), install.reused
    if not install.ok:
        log(f"[{combo.name}] could not install: {install.error}")
        result.failure = Cell("could-not-install", install.error or "")
        return result
    venv = root / combo.name
    result.installed = installed_versions(venv)
    if (checkout := megatron_lm_checkout()) is not None:  # the mHC repros' dev tree, if named
        commit = checkout_commit(checkout)
        result.installed["megatron-lm-dev"] = commit[:8] if re.fullmatch(r"[0-9a-f]{40}", commit) \
            else f"{checkout.name} ({commit})"
    log(f"[{combo.name}] {'reused' if install.reused else 'built'} in {install.seconds:.0f}s: "
        f"{result.installed}; running python -m repro ...")
    out = venv / "repro.json"
    out.unlink(missing_ok=True)
    env = checkout_env(repo, STACKFIX_VERL_ROOT=str(venv / VERL_DIR))
    start = time.monotonic()
    try:
        done = subprocess.run([install.python, "-m", "repro", "--device", device, "--json", str(out)],
                              cwd=repo, env=env, capture_output=True, text=True,
                              timeout=RUNNER_TIMEOUT)
        (venv / "repro.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        runner_error = f"runner exit {done.returncode}: {last_error_line(done.stderr)}"
    except subprocess.TimeoutExpired:
        runner_error = f"runner timed out after {RUNNER_TIMEOUT:.0f}s"
    result.run_seconds = round(time.monotonic() - start, 1)
    result.date = now()
    absent = combo.absent_reasons
    try:
        result.cells = cells_from_runner(json.loads(out.read_text()), absent)
    except (OSError, ValueError) as exc:  # no JSON, or not the runner's: the run itself broke
        result.failure = Cell("could-not-run", f"{runner_error} ({exc.__class__.__name__})")
    log(f"[{combo.name}] ran in {result.run_seconds:.0f}s")
    return result
