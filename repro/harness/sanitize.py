"""The repro children's switch for ``fixes.sanitize``: ``STACKFIX_SANITIZE`` in the environment
(``python -m repro --sanitize`` sets it to the sanitizers each repro declares) runs a repro, and
every rank it launches, under those sanitizers: a comma-separated list of ``NAMES``; an on value
(``fixes.switch``: 1, true, yes, on) is ``storage,mesh``; empty or an off value none."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from fixes.switch import SPELLINGS, on_off

ENV = "STACKFIX_SANITIZE"
NAMES = ("storage", "mesh", "recompute")
DEFAULT = ("storage", "mesh")


def requested() -> tuple[str, ...]:
    """The sanitizers ``STACKFIX_SANITIZE`` names (ValueError naming what is allowed otherwise)."""
    value = os.environ.get(ENV, "")
    if not value.strip():
        return ()
    state = on_off(value)
    if state is not None:
        return DEFAULT if state else ()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise ValueError(f"{ENV}={value!r}: unknown sanitizer(s) {unknown}; allowed: a "
                         f"comma-separated list of {', '.join(NAMES)}, or on "
                         f"({','.join(DEFAULT)}) / off: {SPELLINGS}")
    return names


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
