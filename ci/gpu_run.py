"""The GPU runs that make committed evidence, as named targets of one runner.

Run on the GPU machine from the repository root, after ``. ci/gpu_env.sh`` (``bash
ci/gpu_offline.sh TARGET ...`` does both)::

    python3 ci/gpu_run.py --out DIR [--parallel] [--limit SECONDS] TARGET [TARGET ...]
    python3 ci/gpu_run.py --out DIR STEP ...     # steps by name (a session to remake)
    python3 ci/gpu_run.py --list                 # the targets and their commands
    python3 ci/gpu_run.py --out DIR --parallel stale  # what the last changes left out of date
    python3 ci/gpu_run.py --dry-run TARGET ...   # print the commands, run nothing

Every step's output goes into ``steps.log`` under ``--out`` (one section per step, headed by its
command, exit status and seconds), and at most one JSON of its own beside it; ``run.json``
records the commit, each step's exact command, exit status and seconds, so an evidence README
names the runner, its arguments and that file. ``--parallel`` starts the steps side by side, as
many at once as the card's memory holds (each step declares what it holds, ``Step.gib``: all of
the refresh's memory sessions at once fit the H200 and ran an 80 GB H100 out of memory), but
those marked ``alone`` (whose figures are times), which run first, one at a time, on the host as
the call found it: after the side-by-side sessions the H200's host-bound steps ran up to 2.5x
slower and noisier than on a fresh machine (the sanitizer benchmark's unsanitized steps, three
refreshes against a run alone), and the 1% step-time gate failed there (30273be) and passed first
thing on a fresh machine. A step started beside others gets ``STACKFIX_GPU_SHARED_BY``
(``SHARED_GPU``), where a time gate skips. When a step ends, whatever it left running is
killed and named in its record (``left_running``: every process carrying its
``STACKFIX_GPU_STEP`` mark), and a step run alone records the host's load when it started
(``load_at_start``): a refresh whose timed sessions ran at twice their usual step times
(9f4d346) could not say what else was running then. ``--limit`` is the device call's limit
less its set-up: what still runs then is cut by the runner itself, which still writes its
record (a call's own timeout killed the runner with its record, 6c0a6d9). ``stale`` is the
refresh's steps whose published figures (the newest GPU run of each scenario a step makes,
``Step.scenarios``) are older than the code (``benchmarks._freshness``), or never published:
after a change under ``fixes/sanitize/`` the sanitizers' sessions alone, not the whole refresh
(529-589 s on an H100). A step can be named in place of a target
(``--list`` names each). The device tool brings back at most 8 files: the runner says when a
selection writes more.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # ci/ is no package; benchmarks._children is standard library only
from benchmarks._children import AT_ONCE  # noqa: E402

PY = "python3"
MAX_FILES = 8  # what one device call brings back
CALL_SECONDS = 600  # one device call's limit: refresh-times' step limits, set-up aside, fit it
# Set in the environment of a step started beside others under --parallel (the number of steps
# the call runs side by side; fewer may hold the card at once where its memory is the limit,
# Step.gib): its step times measure the other sessions' work too, so a time gate skips
# there (benchmarks/test_bench_megatron_scale.py) and the target runs it alone before them.
SHARED_GPU = "STACKFIX_GPU_SHARED_BY"
# the card's memory in GiB where nvidia-smi is not to be asked (tests; a card shared by others)
DEVICE_GIB = "STACKFIX_GPU_GIB"
# what the sessions started together may hold of the card's memory: the rest is the CUDA
# contexts' and the caching allocators' slack
DEVICE_SHARE = 0.9
# every step's environment: "<runner pid>:<step>", how what it leaves running is found
STEP_MARK = "STACKFIX_GPU_STEP"
PYTEST = [PY, "-m", "pytest", "-p", "no:cacheprovider", "-rA"]
RECLAIM_TESTS = ["tests/test_recompute_reclaim.py", "tests/test_reclaim_holders.py",
                 "tests/test_reclaim_install_order.py", "tests/test_verl_reclaim.py",
                 "tests/test_reclaim_value_safety.py"]
SANITIZER_TESTS = ["tests/test_sanitize_recompute_gpu.py", "tests/test_sanitize_fused_print.py",
                   "tests/test_sanitize_mesh.py", "tests/test_sanitize_storage.py"]
# Megatron-LM's tests at the installed megatron-core's tag (git archive core_v0.19.0 tests/
# __init__.py tests/unit_tests tests/test_utils into .megatron-tests/core_v0.19.0; carried)
MEGATRON_TESTS = ".megatron-tests/core_v0.19.0"
# the benchmark files (benchmarks/test_bench_<name>.py) of the checkpointed stack: with
# megatron_scale, sanitize and fused_print (kernel times: alone), every benchmark file the
# refresh target runs; each with the device memory its session holds at most (GiB: its largest
# peak_bytes on the H100 at 68d0102 -- 5.8, 2.1, 22.1, 0.1 -- with the allocator's slack and a
# context)
STACK_FAMILIES = {"activation_checkpoint": 8, "backward_threads": 4, "output_discard": 26,
                  "reclaim": 2}
# the scenario family of a stack benchmark file whose name is not its family's
STACK_SCENARIOS = {"reclaim": "recompute-reclaim"}
# a megatron-scale child's device memory by size (GiB; benchmarks._children: ~12 and ~4 on the
# H200); a session sharing the GPU runs AT_ONCE of them together
MEGATRON_CHILD_GIB = {"1024x2048": 4, "2048x4096": 12}


@dataclass
class Step:
    name: str  # the log is <name>.log
    argv: list[str]
    timeout: int  # seconds
    json: str | None = None  # a JSON file the step writes, under --out
    env: dict[str, str] = field(default_factory=dict)
    # a step whose figures are times: under --parallel it still runs alone, before the others
    alone: bool = False
    # device memory the step holds at most (GiB), children included: under --parallel a step
    # starts only once it fits beside those running (the refresh's memory sessions held ~130
    # GiB together: on an 80 GB H100 NCCL's set-up ran out of memory in most megatron cells)
    gib: float = 0.0
    # the published scenarios whose figures (or gate) it makes, as fnmatch patterns: the
    # ``stale`` target chooses it where one of them is older than the code (``stale_steps``)
    scenarios: tuple[str, ...] = ()


def _cell_args(*cells: str) -> list[str]:
    """``--cell C`` for each of ``cells`` (benchmarks._sanitize_megatron's MODEL:SIZE:DTYPE:AUX:
    RECOMPUTE), as the runners that take several cells are given them."""
    return [arg for cell in cells for arg in ("--cell", cell)]


def _steps(out: str) -> dict[str, list[Step]]:
    """Target -> its steps (``out``: where their files go)."""
    o = lambda name: f"{out}/{name}"  # noqa: E731
    # the sanitizers' step-time ratios, alone on the GPU (the refresh's first session)
    sanitize = Step("bench-gpu-sanitize", [
        *PYTEST, "benchmarks/test_bench_sanitize.py", "-m", "gpu", "-p", "no:xdist", "-q",
        f"--benchmark-json={o('bench-gpu-sanitize.json')}"], 250, json="bench-gpu-sanitize.json",
        alone=True, scenarios=("recompute-sanitizer/*", "sanitizers/plain-transformer-*"))
    # the megatron reclaim's 1% step-time gate, alone on the GPU: beside the memory sessions it
    # skips (SHARED_GPU), as a step time there measures the other sessions too
    steptime_gate = Step("bench-gpu-megatron-steptime-gate", [
        *PYTEST, "benchmarks/test_bench_megatron_scale.py", "-m", "gpu", "-k",
        "step_time_within_one_percent", "-p", "no:xdist", "-q"], 240, alone=True,
        scenarios=tuple(f"megatron-scale/{m}/*" for m in ("moe", "moe-kept-probs", "gpt-mtp")))
    # the fused print's kernel times, alone: beside ten sessions its child's CPU reference print
    # did not end in 330 s (an H200 refresh at b6f7d12)
    fused = Step("bench-gpu-fused-print", [
        *PYTEST, "benchmarks/test_bench_fused_print.py", "-m", "gpu", "-p", "no:xdist", "-v",
        "-o", "faulthandler_timeout=60",
        f"--benchmark-json={o('bench-gpu-fused_print.json')}"], 90,
        json="bench-gpu-fused_print.json", alone=True, scenarios=("sanitizers/fused-print-*",))
    # the benchmarks' memory sessions, side by side (their figures are per process)
    memory = [
        *(Step(f"bench-gpu-megatron-{model}-{size}", [
            *PYTEST, "benchmarks/test_bench_megatron_scale.py", "-m", "gpu", "-k",
            f"({select}) and {size}", "-p", "no:xdist", "-q",
            f"--benchmark-json={o(f'bench-gpu-megatron-{model}-{size}.json')}"],
            330, json=f"bench-gpu-megatron-{model}-{size}.json",
            gib=MEGATRON_CHILD_GIB[size] * AT_ONCE, scenarios=(f"megatron-scale/{model}/{size}/*",))
          for model, select in (("moe", "moe- and not kept and not ep2"),
                                ("moe-kept-probs", "kept"), ("gpt-mtp", "gpt-mtp"))
          for size in ("1024x2048", "2048x4096")),
        # the checkpointed stack's families, one session per file: pytest-benchmark writes
        # its JSON when the session ends, and one session for all five was cut at its limit
        # three times beside the megatron sessions (a slow child held the others' figures);
        # -v and a traceback of every thread of a test still running after 120 s
        *(Step(f"bench-gpu-{name.replace('_', '-')}", [
            *PYTEST, f"benchmarks/test_bench_{name}.py", "-m", "gpu", "-p", "no:xdist", "-v",
            "-o", "faulthandler_timeout=120",
            f"--benchmark-json={o(f'bench-gpu-{name}.json')}"], 330, json=f"bench-gpu-{name}.json",
            gib=gib, scenarios=(f"{STACK_SCENARIOS.get(name, name.replace('_', '-'))}/*",))
          for name, gib in STACK_FAMILIES.items()),
    ]
    return {
        # the whole gpu suite and the skip audit; the GPU main job
        "suite": [Step("pytest-gpu", [*PYTEST, "tests", "-m", "gpu", "-n", "8", "-q",
                                      "--durations=25", "-p", "repro.harness.skip_audit",
                                      "--skip-audit=gpu"], 420)],
        "repro": [Step("repro-cuda", [PY, "-m", "repro", "--device", "cuda", "--json",
                                      o("repro-cuda.json")], 300, json="repro-cuda.json")],
        # the reclaim (issue 29): its gpu tests (compute-sanitizer memcheck on the fixed and
        # unfixed paths, the CUDA alias-graph batch, verl's releases in both orders)
        "reclaim": [Step("pytest-gpu-reclaim", [*PYTEST, *RECLAIM_TESTS, "-m", "gpu", "-n", "4",
                                                "-q"], 420)],
        # the sanitizers' gpu tests (every tests/test_sanitize_* file with a gpu case), to run
        # with refresh-sanitizers after a change under fixes/sanitize/
        "sanitizer-tests": [Step("pytest-gpu-sanitizers", [*PYTEST, *SANITIZER_TESTS, "-m",
                                                           "gpu", "-n", "4", "-q"], 120)],
        # peak / kept between steps / gradient digests on the real megatron models, every
        # one-GPU cell, one measured step each (no step times: see steptime), ours beside no
        # reclaim, verl 0.8.0 and the rival fixes (Megatron-LM #6339, miles #2862's gc.collect);
        # one step per model, so that --parallel runs them side by side
        "megatron-scale": [Step(f"megatron-scale-{model}", [
            PY, "-m", "benchmarks.megatron_scale", "--device", "cuda", "--models", model,
            "--strategies", "none,verl-0.8.0,megatron-6339,gc-collect,ours",
            "--sizes", "1024x2048,2048x4096",
            "--dtypes", "fp32,bf16", "--steps", "3", "--out", o(f"megatron-scale-{model}.json")],
            540, json=f"megatron-scale-{model}.json")
            for model in ("moe", "moe-kept-probs", "gpt-mtp")],
        # step time / none, alone on the GPU: 40 interleaved steps at the largest size
        "steptime": [Step("megatron-scale-steptime", [
            PY, "-m", "benchmarks.megatron_scale", "--device", "cuda",
            "--models", "moe,gpt-mtp", "--strategies", "none,ours", "--sizes", "2048x4096",
            "--dtypes", "fp32,bf16", "--steps", "40", "--out", o("megatron-scale-steptime.json")],
            540, json="megatron-scale-steptime.json")],
        # Megatron-LM's own unit tests once per reclaim: outcomes must not depend on it
        "megatron-unit-tests": [Step("megatron-unit-tests", [
            PY, "-m", "benchmarks.megatron_unit_tests", "--tests", MEGATRON_TESTS,
            "--reclaims", "none,ours,verl-0.8.0,verl-0.9.1", "--timeout", "300",
            "--json", o("megatron-unit-tests.json")], 560, json="megatron-unit-tests.json")],
        # the recompute sanitizer on the real models: no false alarm, its cost per mode; its
        # host time per op next to a pass-through dispatch mode's
        "sanitizer": [
            Step("bench-gpu-sanitize-and-gpu-tests", [
                *PYTEST, "benchmarks/test_bench_sanitize.py",
                "tests/test_sanitize_recompute_gpu.py", "-m", "gpu", "-p", "no:xdist", "-s",
                f"--benchmark-json={o('bench-gpu-sanitize-and-gpu-tests.json')}"], 420,
                json="bench-gpu-sanitize-and-gpu-tests.json"),
            Step("sanitizer-per-op-cuda", [
                PY, "-m", "benchmarks.sanitizer_per_op", "--device", "cuda", "--json",
                o("sanitizer-per-op-cuda.json")], 120, json="sanitizer-per-op-cuda.json")],
        # its cost on the real megatron models alone on the GPU, fp32 (the MoE GPT with the aux
        # loss off and on, full and MoE-layer recompute; GPT+MTP)
        "sanitizer-cost": [Step("bench-gpu-sanitize-megatron", [
            *PYTEST, "benchmarks/test_bench_sanitize.py", "-m", "gpu", "-k", "megatron and fp32",
            "-p", "no:xdist", "-s", f"--benchmark-json={o('bench-gpu-sanitize-megatron.json')}"],
            300, json="bench-gpu-sanitize-megatron.json")],
        # the detect tier's fused print (one Triton kernel per region side): its gpu tests,
        # then one MoE layer's saved tensors printed fused and per tensor (fp32, bf16)
        "fused-print": [
            Step("pytest-gpu-fused-print", [*PYTEST, "tests/test_sanitize_fused_print.py",
                                            "-m", "gpu", "-p", "no:xdist", "-q"], 300),
            Step("fused-print-moe-layer", [
                PY, "-m", "benchmarks.fused_print", "--device", "cuda", "--size", "1024x2048",
                "--dtypes", "fp32,bf16", "--json", o("fused-print.json")], 300,
                json="fused-print.json")],
        # the fused kernel's launch shapes timed on one MoE layer's saved tensors (how
        # _fused.CHUNK / BLOCK / NUM_WARPS were chosen)
        "fused-print-sweep": [Step("fused-print-sweep", [
            PY, "-m", "benchmarks.fused_print", "--device", "cuda", "--size", "1024x2048",
            "--dtypes", "fp32,bf16", "--repeats", "10", "--sweep", "--json",
            o("fused-print-sweep.json")], 300, json="fused-print-sweep.json", alone=True)],
        # where a sanitized step's host time goes on the real models in bf16, whose steps are
        # the shortest (cProfile per values mode; the MoE GPT with the aux loss off and on,
        # full and MoE-layer recompute; GPT+MTP)
        "sanitizer-profile": [Step(f"sanitize-{model}-{name}", [
            PY, "-m", "benchmarks._sanitize_megatron", "--model", model, "--device", "cuda",
            "--size", "1024x2048", "--dtype", "bf16", "--steps", "4", *args.split(),
            "--profile", o(f"profile-{model}-{name}.txt")], 100,
            json=f"profile-{model}-{name}.txt")
            for model, name, args in (
                ("moe", "bf16-aux0-full", "--aux-loss 0 --recompute full"),
                ("moe", "bf16-aux0p01-full", "--aux-loss 0.01 --recompute full"),
                ("moe", "bf16-aux0p01-moe-layer", "--aux-loss 0.01 --recompute moe-layer"),
                ("gpt-mtp", "bf16-full", "--recompute full"))],
        # two GPUs (kind nvidia-h200-x2): the MoE GPT with its experts over two NCCL ranks, the
        # bench's cells and the CLI's step times; the suite's and the repros' two-rank tests
        # run in "suite" and "repro" once two GPUs are there
        "two-gpu": [
            Step("bench-megatron-scale-ep2", [
                *PYTEST, "benchmarks/test_bench_megatron_scale.py", "-m", "gpu", "-k", "ep2",
                "-p", "no:xdist", f"--benchmark-json={o('bench-megatron-scale-ep2.json')}"], 420,
                json="bench-megatron-scale-ep2.json"),
            Step("megatron-scale-ep2", [
                PY, "-m", "benchmarks.megatron_scale", "--device", "cuda", "--models", "moe",
                "--ep", "2", "--strategies", "none,verl-0.8.0,ours", "--sizes",
                "1024x2048,2048x4096", "--dtypes", "fp32,bf16", "--steps", "20", "--out",
                o("megatron-scale-ep2.json")], 420, json="megatron-scale-ep2.json")],
        # the one-GPU megatron-scale bench cells (every strategy, the rivals included: the
        # README's headline rows), one step per model so each fits one call; file each JSON
        # with benchmarks.record
        "bench-megatron-scale": [Step(f"bench-megatron-scale-{model}", [
            *PYTEST, "benchmarks/test_bench_megatron_scale.py", "-m", "gpu", "-k", select,
            "-p", "no:xdist", f"--benchmark-json={o(f'bench-megatron-scale-{model}.json')}"], 560,
            json=f"bench-megatron-scale-{model}.json")
            for model, select in (("moe", "moe- and not kept and not ep2"),
                                  ("moe-kept-probs", "moe-kept-probs"), ("gpt-mtp", "gpt-mtp"))],
        "bench": [Step("bench-gpu", [*PYTEST, "benchmarks", "-m", "gpu", "-p", "no:xdist",
                                     f"--benchmark-json={o('bench-gpu.json')}"], 540,
                       json="bench-gpu.json")],
        # every one-GPU figure the README and the dashboard publish, in one call (run it with
        # --parallel): each session whose figures are times alone on the GPU, then the
        # benchmarks' other gpu cases split into sessions started side by side (their memory
        # figures are per process). Each session writes one pytest-benchmark JSON; `python -m
        # benchmarks.record` files each, and `python -m benchmarks.dashboard -o
        # benchmarks/results/dashboard.html --readme README.md` redraws from them.
        # On the H200 at 30273be: 502 s in one call (memory sessions 215 s side by side,
        # sanitizer 131 s, step-time gate 106 s, fused print 48 s).
        "refresh": [*memory, sanitize, steptime_gate, fused],
        # the memory sessions alone (after a change to a measured path whose figures are bytes,
        # benchmarks._freshness.MEASURED_PATHS), and the sessions whose figures are times
        "refresh-memory": memory,
        "refresh-times": [sanitize, steptime_gate, fused],
        # the sanitizers' figures alone: after a change under fixes/sanitize/, which no other
        # family measures
        "refresh-sanitizers": [sanitize, fused],
        # verl's own Megatron engine, three runs per model (ci/gpu_verl_engine.sh; its wheels)
        "verl-engine": [Step("verl-engine", ["bash", "ci/gpu_verl_engine.sh", "run"], 560,
                             env={"EVIDENCE": out})],
        # where the spread of the sanitizer bench's step times comes from (per-step times of
        # the unsanitized cells under the bench's pattern, gc off, pinned; the sanitizer
        # toggled on and off step by step), alone on the GPU
        "step-noise": [Step("step-noise", [
            PY, "-m", "benchmarks.step_noise", "--device", "cuda", "--steps", "40",
            "--values", "none,sampled,all", "--json", o("step-noise.json"),
            *_cell_args("moe:1024x2048:bf16:0:full", "gpt-mtp:1024x2048:bf16:0:full",
                        "moe:1024x2048:fp32:0.01:moe-layer")],
            300, json="step-noise.json", alone=True)],
        # the sanitizer switched on and off step by step on the bf16 cells whose "all" costs
        # most, each way one step under torch.profiler: what it adds on the device
        "sanitizer-device-time": [Step("sanitizer-device-time", [
            PY, "-m", "benchmarks.step_noise", "--device", "cuda", "--steps", "12",
            "--variants", "toggled", "--values", "all,none", "--kernels", "--json",
            o("sanitizer-device-time.json"),
            *_cell_args("gpt-mtp:1024x2048:bf16:0:full", "moe:1024x2048:bf16:0.01:moe-layer")],
            200, json="sanitizer-device-time.json", alone=True)],
        # the sanitizer's own host time per region, stage by stage (and the parts of the
        # site, reach and judge stages), on the GPU's host (the bf16 cells; the MoE GPT with
        # full recompute at 4 and 16 layers: every region reaches the whole block), alone
        "sanitizer-host-time": [Step("sanitizer-host-time", [
            PY, "-m", "benchmarks.sanitizer_host_time", "--device", "cuda", "--steps", "10",
            "--rounds", "3", "--layers", "4,16", "--split", "site,reach,judge",
            "--json", o("sanitizer-host-time.json"),
            *_cell_args("moe:1024x2048:bf16:0:full", "moe:1024x2048:bf16:0.01:moe-layer",
                        "gpt-mtp:1024x2048:bf16:0:full")],
            240, json="sanitizer-host-time.json", alone=True)],
        # diagnostics of earlier sessions: where a CUDA child's time goes; the fork server's
        # threads; the CPU suite on the GPU host
        "child-phases": [Step("child-phases-cuda", [
            PY, "-m", "benchmarks.child_phases", "--device", "cuda", "--probes", "1",
            "--only", "shared-view-reclaim", "--only", "mtp-shape", "--json",
            o("child-phases-cuda.json")], 120, json="child-phases-cuda.json")],
        "forkserver-threads": [Step("forkserver-threads", [
            PY, "ci/diagnose_forkserver_threads.py", "torch"], 120)],
        "cpu-suite": [Step("pytest-cpu-on-gpu-host", [*PYTEST, "tests", "-m", "cpu", "-n", "16",
                                                      "-q", "--tb=short"], 480)],
    }


# a target made at the call: the refresh's steps whose published figures are older than the
# code (``stale_steps``), "whenever a measured path changes" at the cost of what changed
STALE = "stale"
TARGETS = (*_steps("OUT"), STALE)


def stale_steps(steps: list[Step], latest: dict[str, str], stale) -> list[Step]:
    """Of ``steps``, those with a scenario (``Step.scenarios``) whose newest published GPU run
    (``latest``: scenario -> that run's commit) is older than the code its family measures
    (``stale(commit, family)``), or none of whose scenarios any published run has."""
    chosen = []
    for step in steps:
        made = [s for s in latest if any(fnmatch.fnmatchcase(s, p) for p in step.scenarios)]
        if not made or any(stale(latest[s], s.split("/", 1)[0]) for s in made):
            chosen.append(step)
    return chosen


def _stale_refresh(steps: dict[str, list[Step]]) -> list[Step]:
    """``stale_steps`` of the refresh, from this checkout's published runs and git history: of
    each scenario, the run the dashboard and the headline show as current (the newest GPU
    card's latest, ``benchmarks._views.current_gpu_view``)."""
    from benchmarks._freshness import History, freshness
    from benchmarks._published import published_runs
    from benchmarks._views import committed_runs, current_gpu_view, is_gpu, scenario_views

    views = scenario_views(committed_runs(published_runs())[0])
    latest = {v.scenario: current_gpu_view(views, v.scenario).latest.run.commit
              for v in views if is_gpu(v.kind)}
    history = History()
    return stale_steps(steps["refresh"], latest,
                       lambda commit, family: freshness(commit, family, history).stale)


def _commit() -> str:
    """STACKFIX_COMMIT when the caller names it (the device tool's copy of the tree may carry a
    stale .git: it named the session's first commit there), else git's HEAD."""
    if os.environ.get("STACKFIX_COMMIT"):
        return os.environ["STACKFIX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _device_gib() -> float | None:
    """The card's memory in GiB (``DEVICE_GIB``, else the smallest card nvidia-smi lists), or
    None where neither says (no limit)."""
    if os.environ.get(DEVICE_GIB):
        try:
            return float(os.environ[DEVICE_GIB])
        except ValueError:
            raise ValueError(f"{DEVICE_GIB}={os.environ[DEVICE_GIB]!r}: expected the card's "
                             "memory in GiB, e.g. 80") from None
    if shutil.which("nvidia-smi") is None:
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, check=False)
    mib = [float(x) for x in r.stdout.split()] if r.returncode == 0 else []
    return min(mib) / 1024 if mib else None


def _run(steps: list[Step], out: Path, parallel: bool, gib: float | None = None,
         limit: float | None = None) -> list[dict]:
    """The steps one after another, or (``parallel``) those that run ``alone`` first, one at a
    time, then the others side by side, each started once what it holds (``Step.gib``) fits
    beside those running in ``DEVICE_SHARE`` of the card's ``gib`` (None: all at once); their
    records in the order given. ``limit``: seconds from now by which every step has ended --
    one still running then is cut there (its ``timeout`` ends at the limit: exit 124, and
    ``cut`` says why), one not started by then is recorded as such."""
    records: dict[int, dict] = {}
    deadline = None if limit is None else time.monotonic() + limit
    until_limit: set[int] = set()  # steps whose timeout was cut to the limit
    running = {}
    together = [i for i, s in enumerate(steps) if not (parallel and s.alone)]
    alone = [i for i in range(len(steps)) if i not in together]
    budget = None if gib is None else gib * DEVICE_SHARE

    def reap() -> None:
        """Wait for one running step to end; record it."""
        while True:
            for j, (step_j, proc_j, log_j, start_j, mark_j, extra_j) in list(running.items()):
                if proc_j.poll() is not None:  # its own end, not when it was waited for
                    left = _kill_left(mark_j)
                    if left:
                        log_j.write("\n[ci/gpu_run.py] left running after the step, killed: "
                                    + "; ".join(left) + "\n")
                    records[j] = {**_record(step_j, proc_j.returncode, log_j, start_j),
                                  "left_running": left, **extra_j}
                    if proc_j.returncode == 124 and j in until_limit:
                        records[j]["cut"] = f"the call's limit (--limit {limit:g})"
                    del running[j]
                    return
            time.sleep(0.2)

    def start(i: int) -> None:
        step = steps[i]
        seconds = step.timeout
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            records[i] = {**_record(step, None, None, time.monotonic()),
                          "cut": "not started before the call's limit"}
            return
        if left is not None and left < seconds:
            seconds = max(round(left, 1), 0.1)  # ``timeout 0`` would set no limit at all
        log = (out / f"{step.name}.log").open("w")  # folded into steps.log at the end
        env = {k: v for k, v in os.environ.items() if k != SHARED_GPU}
        if parallel and len(together) > 1 and i in together:
            env[SHARED_GPU] = str(len(together))
        env[STEP_MARK] = f"{os.getpid()}:{step.name}"  # inherited by all it starts
        extra = {"load_at_start": os.getloadavg()[0]} if i in alone else {}
        if seconds != step.timeout:
            until_limit.add(i)
        proc = subprocess.Popen(["timeout", str(seconds), *step.argv], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, env={**env, **step.env})
        running[i] = (step, proc, log, time.monotonic(), env[STEP_MARK], extra)

    def fits(i: int) -> bool:
        held = sum(r[0].gib for r in running.values())
        return budget is None or not running or held + steps[i].gib <= budget

    for i in alone if parallel else together:  # one at a time
        start(i)
        if running:
            reap()
    waiting = list(together) if parallel else []
    while waiting:  # the first that fits, in the order given; else wait for room
        i = next((i for i in waiting if fits(i)), None)
        if i is None:
            reap()
        else:
            waiting.remove(i)
            start(i)
    while running:
        reap()
    return [records[i] for i in range(len(steps))]


def _kill_left(mark: str) -> list[str]:
    """Kill every process that carries ``mark`` in its environment (what a step started and
    left running: its own session or process group out of reach of the step's ``timeout``)
    and return each as "PID COMMAND LINE": such a process would load the host under the steps
    after it (Linux: /proc; elsewhere nothing is found)."""
    needle = f"{STEP_MARK}={mark}".encode()
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        left.append(f"{proc.name} {command}")
    # gone before the next step starts (a SIGKILLed process still ran for a moment)
    deadline = time.monotonic() + 5
    for entry in left:
        stat = Path(f"/proc/{entry.split(' ', 1)[0]}/stat")
        while time.monotonic() < deadline:
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except (OSError, IndexError):
                break
            time.sleep(0.01)
    return left


def _record(step: Step, rc: int | None, log, start: float) -> dict:
    """A step's record; ``rc`` None (and no ``log``): it never started."""
    if log is not None:
        log.close()
    seconds = round(time.monotonic() - start, 1)
    print(f"{step.name}: " + ("not started" if rc is None else f"exit {rc} in {seconds} s"),
          flush=True)
    return {"name": step.name, "argv": step.argv, "env": step.env, "timeout": step.timeout,
            "exit": rc, "seconds": seconds, "json": step.json}


def _fold_logs(records: list[dict], out: Path) -> None:
    """Each step's log into one ``steps.log``, in the order the steps were given."""
    with (out / "steps.log").open("w") as folded:
        for r in records:
            if r["exit"] is None:
                folded.write(f"===== {r['name']}: {r['cut']}: {' '.join(r['argv'])}\n\n")
                continue
            log = out / f"{r['name']}.log"
            folded.write(f"===== {r['name']}: exit {r['exit']} in {r['seconds']} s: "
                         f"{' '.join(r['argv'])}\n")
            folded.write(log.read_text(errors="replace"))
            folded.write("\n")
            log.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 ci/gpu_run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="*", metavar="TARGET", help=f"one of {', '.join(TARGETS)}")
    p.add_argument("--out", default=os.environ.get("EVIDENCE", "gpu-evidence"),
                   help="where the logs, JSON and run.json go ($EVIDENCE)")
    p.add_argument("--parallel", action="store_true",
                   help="first the steps whose figures are times, one at a time; then every "
                   "other step at once")
    p.add_argument("--limit", type=float, metavar="SECONDS",
                   help="end every step by this many seconds from the start (the device "
                   "call's limit less the set-up): a step still running is cut, one not "
                   "started is recorded as such, and steps.log and run.json are still written")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--list", action="store_true", help="list the targets and their commands")
    args = p.parse_args(argv)
    if args.limit is not None and not args.limit > 0:
        p.error(f"--limit {args.limit:g}: seconds > 0")
    steps = _steps(args.out)
    if args.list:
        for name, target in steps.items():
            for step in target:
                print(f"{name}: {step.name}: {' '.join(step.argv)}")
        print(f"{STALE}: the steps of refresh whose published figures are older than the code, "
              "chosen at the call (--dry-run stale names them)")
        return 0
    # a step's own name selects that step alone (a session to remake, as a failed one)
    by_name = {s.name: [s] for target in steps.values() for s in target}
    if STALE in args.targets:
        steps[STALE] = _stale_refresh(steps)
        if not steps[STALE] and args.targets == [STALE]:
            print("nothing older than the code")
            return 0
    unknown = [t for t in args.targets if t not in steps and t not in by_name]
    if unknown or not args.targets:
        p.error(f"{'unknown target(s) ' + ', '.join(unknown) if unknown else 'no target'}; "
                f"allowed: {', '.join(TARGETS)}, or a step's name (--list)")
    chosen = list({id(s): s for t in dict.fromkeys(args.targets)
                   for s in steps.get(t) or by_name[t]}.values())
    files = 3 + sum(s.json is not None for s in chosen)  # steps.log, run.json, environment.txt
    if files > MAX_FILES:
        print(f"note: {files} files under {args.out}; one device call brings back "
              f"{MAX_FILES}", file=sys.stderr)
    if args.dry_run:
        for step in chosen:
            print(" ".join(step.argv))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    gib = _device_gib() if args.parallel else None
    records = _run(chosen, out, args.parallel, gib, args.limit)
    _fold_logs(records, out)
    (out / "run.json").write_text(json.dumps(
        {"commit": _commit(), "started": started, "targets": args.targets,
         "parallel": args.parallel, "device_gib": gib, "limit_s": args.limit,
         "steps": records}, indent=1))
    return 0 if all(r["exit"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
