"""Where a call came from (``fixes.sanitize._callsite.call_site``): asked once per checkpointed
region, so its cost is per region of every step."""

from __future__ import annotations

import os

import pytest

from fixes.sanitize import _callsite

pytestmark = pytest.mark.cpu


def _site():
    return _callsite.call_site()


def _sites(n: int) -> list[tuple[str, ...]]:
    return [_site() for _ in range(n)]  # one line: the same frames each time


def test_a_frame_is_described_once_not_once_per_region(monkeypatch):
    """The H200 profile of ``values="none"``: ``os.path.relpath`` of each frame outside
    site-packages, per region, was the sanitizer's largest host cost a step."""
    calls: list[str] = []
    relpath = os.path.relpath
    seen = []
    for n in (1, 3):  # the same frames (lines) both times
        if seen:
            monkeypatch.setattr(os.path, "relpath",
                                lambda p, *a: calls.append(p) or relpath(p, *a))
        seen.append(_sites(n))
    first = seen[0][0]
    assert calls == [] and all(s == first for s in seen[1])
    assert first[0].startswith(f"tests{os.sep}test_sanitize_callsite.py:")
    assert first[0].endswith(" in _site")


def test_each_call_line_is_named_as_the_frame_reads_it_and_an_entry_holds_its_code():
    """A frame's entry is looked up by its code object and instruction offset (``f_lineno``
    decodes the line table of the whole function: most of a region's call site on megatron's
    long forwards): two calls from two lines of one function are told apart, each named by
    the line its frame reads; a code object made and dropped at run time (``exec``) cannot
    lend its entry to another that takes its id, because the entry holds it."""
    import sys

    def here():
        return sys._getframe(1).f_lineno

    def two():
        a, line_a = _site(), here()
        b, line_b = _site(), here()
        return (a, line_a), (b, line_b)

    for _ in range(2):  # the second time from the cache
        (a, line_a), (b, line_b) = two()
        assert a[1].endswith(f":{line_a} in two") and b[1].endswith(f":{line_b} in two")
        assert a[0] == b[0] and a[1] != b[1]
    namespace: dict = {"site": _site}
    exec(compile("def made():\n    return site()\n", "made_at_run_time.py", "exec"), namespace)
    code = namespace["made"].__code__
    assert namespace["made"]()[1] == "made_at_run_time.py:2 in made"
    held = [entry for entry in _callsite._AT.values() if entry[0] is code]
    assert held and held[0][1] == "made_at_run_time.py:2 in made"


def test_the_entries_are_bounded(monkeypatch):
    monkeypatch.setattr(_callsite, "_AT", {})
    monkeypatch.setattr(_callsite, "_AT_LIMIT", 3)
    sites = _sites(3)  # each walk clears the entries more than once, and reads the same
    assert 0 < len(_callsite._AT) <= 3 and sites == [sites[0]] * 3
    assert sites[0][0].endswith(" in _site")
