"""One virtualenv per combination: find the interpreter, install once, reuse, record versions.

A venv is reused while the spec it was built from (``stackfix-compat.json`` inside it) equals
the combination's; anything else rebuilds it. The repo itself is not installed: the runner runs
with the checkout on ``PYTHONPATH``, so one venv serves every commit.

The packages go in with uv where the driver can run it (``tox -m compat`` installs it): one
download per wheel, hard-linked from uv's cache into every venv, in seconds where pip took
minutes per combination. A combination on the host's own torch (a venv with system
site-packages, the GPU column) keeps pip, which counts that torch as installed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from repro.compat.combos import SYSTEM_TORCH, Combination

MARKER = "stackfix-compat.json"
# uv's constraint and override files, which tox sets for every env (ci/constraints-cpu.txt pins
# torch 2.13.0): a combination's requirements alone say what it installs.
PINS_NOT_PASSED = ("UV_CONSTRAINT", "UV_OVERRIDE", "PIP_CONSTRAINT")
VERL_DIR = "verl-releases"
# What the matrix records of each venv (pip names, normalised).
KEY_PACKAGES = ("torch", "spmd-types", "torchtitan", "megatron-core", "torch-remat", "triton",
                "numpy")


@dataclass(frozen=True)
class Install:
    """How building (or reusing) one venv went; ``error`` is pip's last line on failure."""

    ok: bool
    python: str | None
    seconds: float
    reused: bool = False
    error: str | None = None


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _python_version(executable: str) -> str | None:
    try:
        out = subprocess.run([executable, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_python(version: str) -> str:
    """An interpreter for ``version`` ("3.12"): ``pythonX.Y`` on PATH if it runs (a pyenv shim
    for an unselected version does not), else the newest ``~/.pyenv/versions/X.Y.*``."""
    if _python_version(sys.executable) == version:
        return sys.executable
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")),
                         key=lambda p: [int(x) for x in re.findall(r"\d+", p.split("versions/")[1])],
                         reverse=True)
    for candidate in filter(None, candidates):
        if _python_version(candidate) == version:
            return candidate
    raise LookupError(f"no Python {version} found (tried python{version} on PATH and "
                      f"~/.pyenv/versions/{version}.*)")


def last_error_line(text: str) -> str:
    """The installer's verdict: the last ``ERROR:`` (pip) or ``error:`` (uv) line, else the last
    non-empty line (uv's resolver ends with its reason)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("ERROR:", "error:"))]
    return (errors or lines or ["(no output)"])[-1]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def create_venv(base: str, venv: Path, system_site: bool = False) -> Path:
    """A fresh venv at ``venv`` (an old one is removed) from interpreter ``base``."""
    if venv.exists():
        shutil.rmtree(venv)
    flags = ["--system-site-packages"] if system_site else []
    subprocess.run([base, "-m", "venv", *flags, str(venv)], check=True, capture_output=True)
    return venv_python(venv)


def checkout_env(repo: Path, **extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (the repo is never installed)."""
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def uv_binary() -> str | None:
    """uv's executable where the driver can run one (the ``uv`` package's, else ``uv`` on PATH)."""
    try:
        import uv  # the PyPI package ships the binary beside its module

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def _find_links() -> list[str]:
    """pip's ``PIP_FIND_LINKS`` (this machine's local wheels, ``--wheels``) as uv arguments: uv
    reads no pip setting, and without them it downloads PyPI's CUDA torch for a CPU venv."""
    return [arg for link in os.environ.get("PIP_FIND_LINKS", "").split()
            for arg in ("--find-links", link)]


def install_command(python: Path, combo: Combination, uv: str | None) -> list[str]:
    """The command that installs ``combo``'s requirements into the venv of ``python``."""
    if uv and combo.torch != SYSTEM_TORCH:
        offline = ["--no-index"] if os.environ.get("PIP_NO_INDEX") else []
        return [uv, "pip", "install", "--python", str(python), *offline, *_find_links(),
                *combo.requirements]
    return [str(python), "-m", "pip", "install", "--progress-bar", "off", *combo.requirements]


def _run(argv: list[str], combo: Combination, repo: Path):
    """``argv`` in the checkout; pip reads no configuration file if the combination lifts the cap
    (PIP_CONFIG_FILE=os.devnull is pip's documented off switch; uv reads none anyway)."""
    env = checkout_env(repo, PIP_DISABLE_PIP_VERSION_CHECK="1")
    if combo.lift_pip_cap:
        env["PIP_CONFIG_FILE"] = os.devnull
    for pin in PINS_NOT_PASSED:  # the combination names its versions; tox's CPU pin is not one
        env.pop(pin, None)
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=repo, timeout=3600)


def ensure_venv(combo: Combination, root: Path, repo: Path, *, reinstall: bool = False,
                uv: str | None = None) -> Install:
    """Build ``root/<combo.name>`` unless an identical one exists, installing with ``uv`` when
    given (else pip); never raises for the installer."""
    start = time.monotonic()
    venv = root / combo.name
    marker = venv / MARKER
    spec = json.loads(json.dumps(combo.install_spec()))  # tuples as lists, as read back
    if not reinstall and marker.is_file() and json.loads(marker.read_text()) == spec:
        return Install(True, str(venv_python(venv)), time.monotonic() - start, reused=True)
    try:
        base = find_python(combo.python)
    except LookupError as exc:
        return Install(False, None, time.monotonic() - start, error=str(exc))
    python = create_venv(base, venv, system_site=combo.torch == SYSTEM_TORCH)
    steps = [install_command(python, combo, uv)]
    if combo.verl_versions:  # verl's own installer: pip install --no-deps --target ROOT/VERSION
        steps.append([str(python), "-m", "repro.verl_release", "install", "--root",
                      str(venv / VERL_DIR), *combo.verl_versions])
    for argv in steps:
        done = _run(argv, combo, repo)
        if done.returncode != 0:
            return Install(False, str(python), time.monotonic() - start,
                           error=last_error_line(done.stderr or done.stdout))
    marker.write_text(json.dumps(spec, indent=1))
    return Install(True, str(python), time.monotonic() - start)


def installed_versions(venv: Path) -> dict[str, str]:
    """The KEY_PACKAGES pip lists in ``venv`` and the verl releases unpacked beside it."""
    out = subprocess.run([str(venv_python(venv)), "-m", "pip", "list", "--format=json"],
                         capture_output=True, text=True, timeout=300)
    listed = {_normalise(p["name"]): p["version"] for p in json.loads(out.stdout or "[]")}
    found = {name: listed[name] for name in KEY_PACKAGES if name in listed}
    verls = sorted(p.parent.name for p in (venv / VERL_DIR).glob("*/verl-*.dist-info"))
    if verls:
        found["verl"] = " + ".join(verls)
    return found
