"""Suite-wide rules: every test carries exactly one of the ``cpu`` / ``gpu`` markers, and
``gpu`` tests skip (with the reason) where CUDA is absent instead of erroring. Under xdist each
worker's torch takes its share of the cores. A harness variable with a bad value
(repro.harness.environment) stops the session at once. Tests marked ``deep`` (deep by design:
real models, whole fork-server lifecycles, every repro run twice) are deselected unless the
``-m`` expression names ``deep``: ``pytest -m cpu`` is the fast suite, ``pytest -m deep`` (tox -e
deep) runs the rest; the summary says so."""

from __future__ import annotations

import os

import pytest

from repro.harness import environment

DEVICE_MARKERS = ("cpu", "gpu")
# What a process group can leave in the process that made it: torchrun-style variables (an
# env:// rendezvous reads MASTER_ADDR / MASTER_PORT there), whose TCPStore then holds that port
# for every child the process starts (setup_megatron did this until it used its own store).
WORLD_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _no_rendezvous_left_in_the_worker():
    """A test must not leave rendezvous variables in the pytest worker: every later child
    inherits the worker's MASTER_PORT, and its own ``init_process_group`` then fails with
    EADDRINUSE on the port the worker's TCPStore still holds (five verl tests of one .ci/run
    failed so, after an in-process ``setup_megatron``). A process group on a store that holds
    no port (a module's fake or hash store) is no harm. Run what rendezvouses in a child."""
    before = {k: os.environ.get(k) for k in WORLD_VARIABLES}
    yield
    left = [f"{k}={os.environ[k]}" for k in WORLD_VARIABLES
            if k in os.environ and os.environ.get(k) != before[k]]
    if left:
        pytest.fail(f"the test left {', '.join(left)} in the pytest worker's environment: "
                    "every later child inherits them (run what calls setup_megatron or "
                    "init_process_group over env:// in a child: repro.run_isolated)",
                    pytrace=False)


def pytest_collection_modifyitems(config, items):
    bad = []
    for item in items:
        marks = {m.name for m in item.iter_markers() if m.name in DEVICE_MARKERS}
        if len(marks) != 1:
            bad.append(f"{item.nodeid}: {sorted(marks) or 'no device marker'}")
    if bad:
        raise pytest.UsageError(
            "every test must carry exactly one of the markers cpu / gpu:\n  " + "\n  ".join(bad)
        )
    if "deep" not in (config.getoption("markexpr") or ""):
        deep = [item for item in items if item.get_closest_marker("deep")]
        if deep:
            config.hook.pytest_deselected(items=deep)
            items[:] = [item for item in items if not item.get_closest_marker("deep")]
    if not _cuda_available():
        skip = pytest.mark.skip(reason="CUDA not available (torch.cuda.is_available() is False)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def pytest_configure(config):
    if problems := environment.problems():
        raise pytest.UsageError("\n".join(problems))
    # ``-n auto`` starts one worker per core, and torch's intra-op pool defaults to every core:
    # each worker's in-process ops would then spin as many threads as the machine has, all
    # workers at once, next to the children and ranks the other workers run. Children keep
    # their default: this sets the worker's pool, not its environment.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_terminal_summary(terminalreporter, config):
    if "deep" not in (config.getoption("markexpr") or ""):  # the controller's, under xdist
        terminalreporter.write_line("tests marked deep were left out of this run "
                                    "(run them: pytest -m deep, or tox -e deep)")
