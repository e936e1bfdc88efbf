"""Where a call came from: a short Python stack of ``file:line in function`` entries, innermost
first, that skips torch's own frames and the sanitizers' (the caller is what a reader needs)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

_SKIPPED_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)
_SKIPPED_FILES = (contextlib.__file__,)  # a ``with`` statement's own frames


def _short_path(path: str) -> str:
    marker = f"site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def call_site(depth: int = 4) -> tuple[str, ...]:
    """Up to ``depth`` frames of the current Python stack outside torch, contextlib and this
    package, innermost first."""
    frame = sys._getframe(1)
    site: list[str] = []
    while frame is not None and len(site) < depth:
        path = frame.f_code.co_filename
        if not (path.startswith(_SKIPPED_DIRS) or path in _SKIPPED_FILES
                or path.startswith("<frozen")):
            site.append(f"{_short_path(path)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(site)


def describe_site(site: tuple[str, ...]) -> str:
    return " <- ".join(site) if site else "(no Python caller outside torch)"
