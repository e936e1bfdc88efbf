"""A dict's version tag: CPython's ``ma_version_tag`` (PEP 509), a number that changes whenever
the dict changes -- an item added, rebound to another object or removed -- and that no other
dict holds, read without calling into the dict.

Why: ``values="all"`` checks once a round that each kept walk of a region's modules still finds
what a fresh walk would (``_reach._Kept.check``), by comparing every module's attributes, and
the objects the walk went into, with the walk's by identity. That comparison was most of
``all``'s reach on the GPU hosts (313 us a region on megatron's GPT+MTP on an H100's host,
``benchmarks/results/evidence/2026-12-06-h100-refresh-a913a85/``): reading hundreds of
attributes with a step's cold caches. A module whose ``__dict__`` kept its tag since the walk
holds the same attributes, bound to the same objects: one number per module.

``tag`` is None where the tag does not behave so -- another interpreter, a CPython whose layout
or stores differ (3.13 stores an attribute into an object's inline values without touching the
tag; 3.14 has no tag) -- as a self-test finds at import; the check then compares the attributes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

try:
    import ctypes
except ImportError:  # an interpreter built without _ctypes: no tags
    ctypes = None

__all__ = ["tag", "tags"]

# PyDictObject: ob_refcnt, ob_type, ma_used, then ma_version_tag (a uint64)
_OFFSET = 3 * ctypes.sizeof(ctypes.c_ssize_t) if ctypes is not None else 0
_AT = ctypes.c_uint64.from_address if ctypes is not None else None


def _read(d: dict) -> int:
    return _AT(id(d) + _OFFSET).value


def tags(dicts) -> list[int]:
    """``tag`` of each of ``dicts``, in one pass (no Python call per dict)."""
    return [_AT(id(d) + _OFFSET).value for d in dicts]


class _Plain:
    pass


def _behaves() -> bool:
    """Whether ``_read`` changes with every change of a dict, and of a plain object's
    ``__dict__`` through attribute stores (asked for before and after them), and differs
    between two dicts."""
    if sys.implementation.name != "cpython" or ctypes is None:  # ``id``: an address there
        return False
    try:
        seen = []
        d = {}
        seen.append(_read(d))
        for change in (lambda: d.__setitem__("k", 1), lambda: d.__setitem__("k", 2),
                       lambda: d.__delitem__("k")):
            change()
            seen.append(_read(d))
        o = _Plain()
        o.x = 1
        fields = vars(o)
        seen.append(_read(fields))
        for change in (lambda: setattr(o, "x", 2), lambda: setattr(o, "y", 3),
                       lambda: object.__setattr__(o, "x", 4), lambda: delattr(o, "y")):
            change()
            seen.append(_read(fields))
        p = _Plain()
        p.x = 1  # written before its __dict__ is asked for
        fields = vars(p)
        before = _read(fields)
        p.x = 2
        seen += [before, _read(fields), _read({"a": 1}), _read({"a": 1})]
        return len(set(seen)) == len(seen)
    except Exception:
        return False


tag: Callable[[dict], int] | None = _read if _behaves() else None
