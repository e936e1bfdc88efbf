"""``ci/gpu_env.sh`` on a copy of the tree (a device machine's): the tree's history from the
carried bundle, and the tracked files left out of the copy back from it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ENV_SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "gpu_env.sh"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def test_a_copy_missing_tracked_files_gets_them_back_from_the_bundle_and_reads_clean(tmp_path):
    """A device's copy of the tree is size-limited: the evidence folders (tracked, tens of
    MiB) are left out of it and the bundle carried instead. Missing there, every run the
    device filed read "-dirty"; they come back from the bundle, and a file changed in the
    copy is left as it is (the run says so)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed here")
    repo = tmp_path / "repo"
    (repo / "evidence").mkdir(parents=True)
    (repo / "evidence" / "log.txt").write_text("a log\n")
    (repo / "code.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("/.gpu/\n/wheels/\n")  # as the repository's own
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD").strip()
    copy = tmp_path / "copy"
    (copy / ".gpu").mkdir(parents=True)
    _git(repo, "bundle", "create", "-q", str(copy / ".gpu" / "head.bundle"), "HEAD")
    (copy / "code.py").write_text("x = 1\n")  # the copy: no .git, no evidence folder
    shutil.copy(repo / ".gitignore", copy / ".gitignore")
    (copy / "wheels").mkdir()
    out = subprocess.run(["bash", "-c", f'WHEELS=wheels . "{ENV_SCRIPT}" && git status --short '
                          '&& echo "commit=$STACKFIX_COMMIT"'], cwd=copy, capture_output=True,
                         text=True, check=True).stdout
    assert (copy / "evidence" / "log.txt").read_text() == "a log\n"
    assert out.splitlines() == [f"commit={head}"]
    (copy / "code.py").write_text("x = 2\n")
    out = subprocess.run(["bash", "-c", f'WHEELS=wheels . "{ENV_SCRIPT}" && git status --short'],
                         cwd=copy, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["M", "code.py"]
