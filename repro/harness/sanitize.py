"""The repro children's switch for ``fixes.sanitize``: ``STACKFIX_SANITIZE=1`` in the
environment (``python -m repro --sanitize`` sets it) runs a repro, and every rank it launches,
under ``storage_sanitizer()`` and ``mesh_sanitizer()``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV = "STACKFIX_SANITIZE"


def sanitizing() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


@contextlib.contextmanager
def sanitizers_from_env() -> Iterator[None]:
    """Both sanitizers around the block when ``STACKFIX_SANITIZE`` is set, nothing otherwise."""
    if not sanitizing():
        yield
        return
    from fixes.sanitize import mesh_sanitizer, storage_sanitizer

    with storage_sanitizer(), mesh_sanitizer():
        yield
