"""The suite's marker rule for benchmarks too: every benchmark (and every unit test here) carries
exactly one of ``cpu`` / ``gpu``, and ``gpu`` ones skip with the reason where CUDA is absent.

``pytest benchmarks`` does not load ``tests/conftest.py`` (it is not on the collected path), so
the hook is loaded from that file rather than written a second time: one rule, one place.
It also loads ``benchmarks.skipped`` (a skipped benchmark reported as a skip).
``tests/`` is not a package, hence the load by path under a private module name.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_TESTS_CONFTEST = Path(__file__).resolve().parent.parent / "tests" / "conftest.py"


def _load_suite_rules():
    spec = importlib.util.spec_from_file_location("_stackfix_suite_rules", _TESTS_CONFTEST)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the suite's marker rules from {_TESTS_CONFTEST}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_rules = _load_suite_rules()
DEVICE_MARKERS = _rules.DEVICE_MARKERS


def pytest_configure(config):
    # A skipped benchmark is reported as a skip, not as pytest-benchmark's INTERNALERROR.
    if not config.pluginmanager.has_plugin("benchmarks.skipped"):
        config.pluginmanager.import_plugin("benchmarks.skipped")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # When tests/ is collected in the same session its conftest applies the rule itself;
    # apply it once, to the benchmark items only, either way.
    here = Path(__file__).resolve().parent
    ours = [item for item in items if here in Path(str(item.path)).resolve().parents]
    _rules.pytest_collection_modifyitems(config, ours)


@pytest.fixture(scope="session")
def figure_book():
    from benchmarks._bench import FigureBook

    return FigureBook()
