"""``python -m repro -j N``: repros side by side, each path its own child, the same outcomes
and the same table order as a sequential run; the default is 1 on CPU and sized from the GPU's
memory and the host's cores on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repro.__main__ import CUDA_BYTES_PER_JOB, MAX_DEFAULT_JOBS, default_jobs

pytestmark = pytest.mark.cpu

GiB = 1 << 30
# Two cheap repros that run and one skipped before any child: rows of all three kinds.
_ONLY = ["mesh-recompute", "mtp-shape-megatron-dev", "mtp-shape"]


def _run(tmp_path, jobs: int) -> tuple[list[dict], list[str]]:
    out = tmp_path / f"j{jobs}.json"
    args = [a for name in _ONLY for a in ("--only", name)]
    env = {k: v for k, v in os.environ.items() if k != "STACKFIX_MEGATRON_LM"}
    proc = subprocess.run([sys.executable, "-m", "repro", *args, "-j", str(jobs), "--json",
                           str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 3, proc.stderr  # the named mtp-shape-megatron-dev was skipped
    rows = json.loads(out.read_text())
    for r in rows:  # the one field that may differ: how long each child took
        for path in ("unfixed", "fixed"):
            r[path].pop("seconds")
    table = [line for line in proc.stdout.splitlines() if line]
    return rows, [" ".join(c for i, c in enumerate(line.split()) if i != 4) for line in table]


@pytest.mark.deep
def test_parallel_run_equals_sequential(tmp_path):
    seq_rows, seq_table = _run(tmp_path, 1)
    par_rows, par_table = _run(tmp_path, 2)
    assert [r["name"] for r in seq_rows] == _ONLY
    assert [r["status"] for r in seq_rows] == ["good", "skipped", "good"]
    assert par_rows == seq_rows
    assert par_table == seq_table


def test_jobs_must_be_positive():
    proc = subprocess.run([sys.executable, "-m", "repro", "-j", "0", "--list"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


@pytest.mark.parametrize("gpu_bytes, cores, jobs", [
    (141 * GiB, 16, MAX_DEFAULT_JOBS),  # one H200 on a 16-core host
    (141 * GiB, 4, 2),                  # few cores: two per child
    (24 * GiB, 64, 1),                  # a small GPU: one child per CUDA_BYTES_PER_JOB
    (2 * CUDA_BYTES_PER_JOB, 64, 2),
    (8 * GiB, 1, 1),                    # never below 1
])
def test_default_jobs_on_cuda(gpu_bytes, cores, jobs):
    assert default_jobs("cuda", gpu_bytes, cores) == jobs


def test_default_jobs_on_cpu_is_one():
    assert default_jobs("cpu", 141 * GiB, 128) == 1
