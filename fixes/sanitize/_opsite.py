"""Which frames of an op's Python stack are the checkpointed region's own code, and the op's
call site: ``raw_site()`` keeps (code object, line) pairs -- formatted only for an error
(``format_site``) -- and says None for an op that machinery runs inside a region (a
checkpoint's saved-tensor hooks, ``fixes.recompute`` putting captured state in place,
torch_remat's SAVE ops), which neither side of the comparison counts."""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint

from fixes.recompute import state as recompute_state
from fixes.sanitize._callsite import _SKIPPED_DIRS, _SKIPPED_FILES, _short_path

_SITE_DEPTH = 3
# Code objects of the frames that enter a region's code from the sanitizer (filled by _region).
BOUNDARIES: set = set()

_USER, _SKIP, _HOOK, _BOUNDARY, _OPAQUE = 0, 1, 2, 3, 4
# Kinds by id(code): a code object's hash is computed anew on every call, from its bytecode,
# names and constants (0.4 us for torch's Module._call_impl), and a model's stack is full of
# large functions. _CODES keeps each one alive, so no id is reused while its kind is cached.
_kind_of_code: dict[int, int] = {}
_CODES: list = []
# Machinery that runs ops inside a region which are not its forward code: the checkpoints'
# own saved-tensor hooks (a recompute's pack hook detaches what it keeps), and fixes.recompute
# putting a region's captured state in place (its copies differ between forward and recompute
# by design).
_HOOK_NAMES = ("pack_hook", "unpack_hook")
_HOOK_FILES = (torch.utils.checkpoint.__file__,)
_STATE_FILE = recompute_state.__file__
# torch_remat's SAVE ops: the body runs in the forward and is skipped in the recompute (its
# outputs loaded instead); neither side is replayed code. Their outputs' values are still
# compared through the ops that read them.
_OPAQUE_NAMES = ("_run_save_op", "_replay_save_op")


def _kind(code) -> int:
    known = _kind_of_code.get(id(code))
    if known is None:
        path = code.co_filename
        if code in BOUNDARIES:
            known = _BOUNDARY
        elif code.co_name in _OPAQUE_NAMES and "torch_remat" in path:
            known = _OPAQUE
        elif path == _STATE_FILE or (code.co_name in _HOOK_NAMES
                                     and (path in _HOOK_FILES or "torch_remat" in path)):
            known = _HOOK
        elif (path.startswith(_SKIPPED_DIRS) or path in _SKIPPED_FILES
              or path.startswith("<frozen")):
            known = _SKIP
        else:
            known = _USER
        _CODES.append(code)
        _kind_of_code[id(code)] = known
    return known


def raw_site(opaque: bool = False) -> tuple | None:
    """The op's caller, raw: up to ``_SITE_DEPTH`` (code, line) pairs outside torch and this
    package, innermost first; None for an op a checkpoint's saved-tensor hook runs (a hook
    frame before any caller's and before the region's own entry: a recompute runs inside the
    unpack hook that triggered it). ``opaque`` (torch_remat regions): the whole stack up to
    the region's entry is read, and an op under a SAVE op is None too."""
    frame, site, in_region = sys._getframe(2), [], False
    kinds = _kind_of_code
    # The hot loop of every recorded op: a dict lookup per frame, _kind only for a new code.
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(id(code))
        if kind is None:
            kind = _kind(code)
        if kind is _USER:
            if len(site) < _SITE_DEPTH:
                site.append((code, frame.f_lineno))
                if len(site) == _SITE_DEPTH and (in_region or not opaque):
                    break
        elif kind is _BOUNDARY:
            in_region = True
            if len(site) >= _SITE_DEPTH:
                break
        elif kind is _HOOK:
            if not site and not in_region:
                return None
        elif kind is _OPAQUE and opaque and not in_region:
            return None
        frame = frame.f_back
    return tuple(site)


def format_site(raw: tuple) -> tuple[str, ...]:
    return tuple(f"{_short_path(c.co_filename)}:{line} in {c.co_name}" for c, line in raw)
