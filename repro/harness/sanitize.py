"""The repro children's switch for ``fixes.sanitize``: ``STACKFIX_SANITIZE`` in the environment
(``python -m repro --sanitize`` sets it to the sanitizers each repro declares) runs a repro, and
every rank it launches, under those sanitizers: a comma-separated list of ``NAMES``; ``1`` is
``storage,mesh``; empty or ``0`` none."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV = "STACKFIX_SANITIZE"
NAMES = ("storage", "mesh", "recompute")
DEFAULT = ("storage", "mesh")


def requested() -> tuple[str, ...]:
    """The sanitizers ``STACKFIX_SANITIZE`` names (ValueError naming an unknown one)."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0"):
        return ()
    if value == "1":
        return DEFAULT
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if unknown := [n for n in names if n not in NAMES]:
        raise ValueError(f"{ENV}={value!r}: unknown sanitizer(s) {unknown}; known: {NAMES}")
    return names


def sanitizing() -> bool:
    return bool(requested())


@contextlib.contextmanager
def sanitizers_from_env() -> Iterator[None]:
    """The sanitizers ``STACKFIX_SANITIZE`` names around the block, nothing when it names none."""
    names = requested()
    if not names:
        yield
        return
    import fixes.sanitize as sanitize

    with contextlib.ExitStack() as stack:
        for name in NAMES:  # always in this order, whatever the list's
            if name in names:
                stack.enter_context(getattr(sanitize, f"{name}_sanitizer")())
        yield
