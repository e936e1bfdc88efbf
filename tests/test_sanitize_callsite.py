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
