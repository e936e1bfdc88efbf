"""pytest plugin: a benchmark test that skips is reported as skipped, in the terminal and in the
``--benchmark-json`` file, instead of breaking pytest-benchmark's report.

Why: pytest-benchmark (5.x) adds a test's stats to the session when ``benchmark(...)`` /
``benchmark.pedantic(...)`` starts, and marks them failed only on an ``Exception``.
``pytest.skip`` raises a ``BaseException``, so a skip raised inside the benchmarked function
(this suite's children report "verl release not installed" that way) leaves stats with no
rounds, and the JSON writer's ``min()`` of them ends the session with ``ValueError: min() arg is
an empty sequence`` -- no results file at all.

Contract: after a test's call phase reports skipped, its stats without rounds are removed from
the session's benchmarks; every skipped test that requested the ``benchmark`` fixture is
listed in the JSON's top-level ``"skipped"`` list as ``{"name": nodeid, "reason": text}``.
Loaded by ``benchmarks/conftest.py``; elsewhere ``-p benchmarks.skipped``.
"""

from __future__ import annotations

import pytest

_SKIPPED_KEY = pytest.StashKey[list]()


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SKIPPED_KEY] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or "benchmark" not in getattr(item, "fixturenames", ()):
        return
    item.config.stash[_SKIPPED_KEY].append({"name": item.nodeid, "reason": _skip_reason(report)})
    session = getattr(item.config, "_benchmarksession", None)
    if session is not None:
        session.benchmarks[:] = [b for b in session.benchmarks
                                 if getattr(getattr(b, "stats", None), "data", None)]


@pytest.hookimpl(optionalhook=True)  # pytest-benchmark's hook: absent under -p no:benchmark
def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    output_json["skipped"] = list(config.stash.get(_SKIPPED_KEY, []))
