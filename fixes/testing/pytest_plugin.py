"""pytest plugin for users' own regression tests (the ``pytest11`` entry point
``stackfix-testing``; without installing, ``-p fixes.testing.pytest_plugin``).

The markers ``cpu`` (runs on any machine) and ``gpu`` (needs CUDA) are registered, so tests
marked as stackfix's own are accepted under ``--strict-markers``; a project that declares
either marker itself keeps its own declaration. Nothing is skipped or selected by them here.

Fixtures, each skipping its test when megatron-core is not installed (a megatron-core that is
installed but fails to import is an error of the test, not a skip: a broken install must not
turn a suite into skips):

- ``megatron_cpu``: ``fixes.testing.megatron_on_cpu()`` around the test; yields
  ``megatron.core.tensor_parallel``;
- ``megatron_recompute_reclaim``: also ``fixes.testing.recompute_reclaim()`` (the reclaim of
  ``fixes.megatron.apply_recompute_reclaim_patch()`` for the test, inside
  ``fixes.megatron.recompute_reclaim_events()``); yields the ``ReclaimEvent`` s.

megatron-core's import-time warnings on a machine without Transformer Engine / Apex and
torch.jit's ``script_method`` deprecation are filtered (``KNOWN_WARNINGS``), ahead of the
project's own ``filterwarnings``.

Loading it imports neither torch nor megatron: pytest loads it in every session of an
environment with stackfix installed.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from fixes.testing import megatron_on_cpu, recompute_reclaim

MARKERS = {"cpu": "runs on any machine (CPU only)", "gpu": "needs CUDA"}
# What importing megatron-core says on a machine without Transformer Engine or Apex (every CPU
# machine the fixtures are for), and torch's deprecation of torch.jit.script_method, which
# megatron-core's modules still use: nothing a user's test can act on. Filed ahead of the
# project's own ``filterwarnings`` and ``-W``, so either can bring one back
# (``-W default::DeprecationWarning``).
KNOWN_WARNINGS = (
    "ignore:Transformer Engine and Apex are not installed:UserWarning:megatron",
    "ignore:Apex is not installed:UserWarning:megatron",
    "ignore:The following imports from `dynamic_context.py` will be removed:DeprecationWarning:megatron",
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit",
)


def pytest_configure(config: pytest.Config) -> None:
    # A `markers` line is "name: help" or "name(args): help".
    declared = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name, help_ in MARKERS.items():
        if name not in declared:
            config.addinivalue_line("markers", f"{name}: {help_}")
    # getini's list is the one pytest applies (addinivalue_line appends to it too): the known
    # warnings go first, so that the project's own lines, which come later, take precedence.
    try:
        config.getini("filterwarnings")[:0] = KNOWN_WARNINGS
    except ValueError:  # -p no:warnings: pytest captures no warnings, there is nothing to filter
        pass


@pytest.fixture
def megatron_cpu():
    """megatron-core's checkpointing on CPU for this test; yields megatron.core.tensor_parallel."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    with megatron_on_cpu():
        yield tensor_parallel


@pytest.fixture
def megatron_recompute_reclaim(megatron_cpu):
    """fixes.megatron's recompute reclaim installed for this test; yields its ReclaimEvents."""
    with recompute_reclaim() as events:
        yield events
