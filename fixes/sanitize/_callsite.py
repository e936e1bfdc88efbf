"""Where a call came from: a short Python stack of ``file:line in function`` entries, innermost
first, that skips torch's, triton's and the sanitizers' own frames (the caller is what a reader
needs);
and the one-at-a-time slot each sanitizer is entered through, which names where the active one
was entered (or who entered it: ``entered_as``, for the pytest plugin)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator

import torch


def _package_dir(name: str) -> str | None:
    """Where an installed package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return os.path.dirname(os.path.abspath(origin)) + os.sep if origin else None


_SKIPPED_DIRS = tuple(filter(None, (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    _package_dir("triton"),  # a kernel launch's own frames (fixes.sanitize.storage checks them)
)))
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


@functools.lru_cache(maxsize=1 << 14)
def _described(path: str, line: int, name: str) -> str | None:
    """A frame's entry, None for one skipped. Cached: every checkpointed region asks from the
    same few lines each step, and ``os.path.relpath`` of a path outside site-packages was the
    largest host cost of ``values="none"`` a step on the H200 (relative to the working
    directory at the first ask)."""
    if path.startswith(_SKIPPED_DIRS) or path in _SKIPPED_FILES or path.startswith("<frozen"):
        return None
    return f"{_short_path(path)}:{line} in {name}"


# (id of a code object, an instruction offset in it) -> (the code object, its frame's entry):
# the code object is held, so its id is not reused while the entry stands
_AT: dict[tuple[int, int], tuple[object, str | None]] = {}
_AT_LIMIT = 1 << 14


def _entry_at(frame) -> str | None:
    """``_described`` of ``frame``, looked up by its code object and instruction offset:
    ``f_lineno`` decodes the code's line table (the longer the function, the longer it takes:
    megatron's layers' forwards), which was most of a region's call site."""
    code = frame.f_code
    key = (id(code), frame.f_lasti)
    hit = _AT.get(key)
    if hit is None:
        if len(_AT) >= _AT_LIMIT:
            _AT.clear()
        hit = _AT[key] = (code, _described(code.co_filename, frame.f_lineno, code.co_name))
    return hit[1]


def call_site(depth: int = 4) -> tuple[str, ...]:
    """Up to ``depth`` frames of the current Python stack outside torch, contextlib and this
    package, innermost first."""
    frame = sys._getframe(1)
    site: list[str] = []
    while frame is not None and len(site) < depth:
        entry = _entry_at(frame)
        if entry is not None:
            site.append(entry)
        frame = frame.f_back
    return tuple(site)


def describe_site(site: tuple[str, ...]) -> str:
    return " <- ".join(site) if site else "(no Python caller outside torch)"


_entering = threading.local()


@contextlib.contextmanager
def entered_as(who: str, hint: str, joinable: bool = False) -> Iterator[None]:
    """Sanitizers entered on this thread inside this block are recorded as entered ``who``
    (e.g. "by the pytest plugin ..."), and a second entry is told ``hint`` (what fixes it).
    ``joinable``: a later entry of the same sanitizer with the same arguments on this thread
    joins the one entered here instead of being refused (a user's own ``with
    storage_sanitizer():`` inside a test the pytest plugin already sanitizes)."""
    saved = getattr(_entering, "label", None)
    _entering.label = (who, hint, joinable)
    try:
        yield
    finally:
        _entering.label = saved


class ActiveSlot:
    """At most one active sanitizer of a kind: ``claim`` it on entry (RuntimeError naming where
    the active one was entered, if any), ``release`` it on exit; ``joinable`` first, for an
    entry that joins an active one entered under ``entered_as(..., joinable=True)``."""

    def __init__(self, name: str):
        self.name = name  # e.g. "storage_sanitizer()"
        self._lock = threading.Lock()
        # (sanitizer, who, hint, joinable by thread ident or None, its arguments)
        self._entry: tuple[object, str, str | None, int | None, str] | None = None

    def joinable(self, arguments: str = "") -> object | None:
        """The active sanitizer, where this thread entered it under ``entered_as(...,
        joinable=True)`` with the same ``arguments`` (a description, e.g. "values='all'"):
        entering again joins it (a no-op: the caller yields it and undoes nothing). None
        otherwise (``claim`` then refuses, naming both arguments where only they differ)."""
        entry = self._entry
        if entry is None or entry[3] != threading.get_ident() or entry[4] != arguments:
            return None
        return entry[0]

    def claim(self, sanitizer: object, site: tuple[str, ...], arguments: str = "") -> None:
        label = getattr(_entering, "label", None)
        who, hint, joinable = label if label is not None else (
            f"at {describe_site(site)}", None, False)
        with self._lock:
            if self._entry is not None:
                _, active_who, active_hint, _, active_arguments = self._entry
                differ = (f" with {active_arguments}, not {arguments}"
                          if active_arguments != arguments else "")
                raise RuntimeError(
                    f"{self.name} is already active (entered {active_who}{differ}); it cannot "
                    "be nested or entered twice at once" + (f": {active_hint}" if active_hint
                                                            else ""))
            self._entry = (sanitizer, who, hint,
                           threading.get_ident() if joinable else None, arguments)

    def release(self) -> None:
        with self._lock:
            self._entry = None

    def holds(self, sanitizer: object) -> bool:
        entry = self._entry
        return entry is not None and entry[0] is sanitizer
