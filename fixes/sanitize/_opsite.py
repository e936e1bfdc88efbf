"""Which frames of an op's Python stack are the checkpointed region's own code, and the op's
call site: ``raw_site()`` keeps (code object, line) pairs -- formatted only for an error
(``format_site``) -- and says None for an op that machinery runs inside a region (a
checkpoint's saved-tensor hooks, ``fixes.recompute`` putting captured state in place,
torch_remat's SAVE ops), which neither side's op stream counts, and returns the declaration
(``_intended.Declaration``) of a built-in intended difference whose code runs the op."""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint

from fixes.recompute import state as recompute_state
from fixes.sanitize import _intended
from fixes.sanitize._callsite import _SKIPPED_DIRS, _SKIPPED_FILES, _short_path

_SITE_DEPTH = 3
# Code objects of the frames that enter a region's code from the sanitizer (filled by _region).
BOUNDARIES: set = set()

_USER, _SKIP, _HOOK, _BOUNDARY, _OPAQUE, _DECLARED = 0, 1, 2, 3, 4, 5
# Kinds by id(code): a code object's hash is computed anew on every call, from its bytecode,
# names and constants (0.4 us for torch's Module._call_impl), and a model's stack is full of
# large functions. _CODES keeps each one alive, so no id is reused while its kind is cached.
_kind_of_code: dict[int, int] = {}
_declaration_of_code: dict[int, _intended.Declaration] = {}
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
    if known is not None:
        return known
    path = code.co_filename
    declared = _intended.built_in(code)
    if code in BOUNDARIES:
        known = _BOUNDARY
    elif declared is not None:
        known = _DECLARED
        _declaration_of_code[id(code)] = declared
    elif code.co_name in _OPAQUE_NAMES and "torch_remat" in path:
        known = _OPAQUE
    elif path == _STATE_FILE or (code.co_name in _HOOK_NAMES
                                 and (path in _HOOK_FILES or "torch_remat" in path)):
        known = _HOOK
    elif path.startswith(_SKIPPED_DIRS) or path in _SKIPPED_FILES or path.startswith("<frozen"):
        known = _SKIP
    else:
        known = _USER
    _CODES.append(code)
    _kind_of_code[id(code)] = known
    return known


def raw_site(opaque: bool = False, depth: int = 2, declared: bool = True,
             entry=None) -> tuple | _intended.Declaration | None:
    """The op's caller, raw: up to ``_SITE_DEPTH`` (code, line) pairs of the region's own code
    -- outside torch and this package, inside the region: the walk stops at the frame that
    enters the region's code from the sanitizer (``BOUNDARIES``) or at ``entry``, the frame
    the region was entered from (a non-reentrant forward has no sanitizer frame between its
    code and its caller) -- innermost first. So the forward's and a recompute's sites of the
    same op are equal, whoever called each. None for an op a checkpoint's saved-tensor hook
    runs (a hook frame before any of the region's own: a recompute runs inside the unpack hook
    that triggered it); the declaration of a built-in intended difference
    (``_intended.built_in``) whose code is among the frames read before the site is complete.
    ``opaque`` (torch_remat regions): the whole stack up to the region's entry is read, and an
    op under a SAVE op is None too. ``depth``: frames between this call and the op's;
    ``declared=False``: built-in declarations' code is read as the region's own (the site of
    a declared write, for its report)."""
    frame, site = sys._getframe(depth), []
    kinds = _kind_of_code
    # The hot loop of every recorded op: a dict lookup per frame, _kind only for a new code.
    while frame is not None and frame is not entry:
        code = frame.f_code
        kind = kinds.get(id(code))
        if kind is None:
            kind = _kind(code)
        if kind is _DECLARED and not declared:
            kind = _USER
        if kind is _USER:
            if len(site) < _SITE_DEPTH:
                site.append((code, frame.f_lineno))
                if len(site) == _SITE_DEPTH and not opaque:
                    break
        elif kind is _BOUNDARY:
            break
        elif kind is _HOOK:
            if not site:
                return None
        elif kind is _DECLARED:
            return _declaration_of_code[id(code)]
        elif kind is _OPAQUE and opaque:
            return None
        frame = frame.f_back
    return tuple(site)


def entry_frame(start):
    """The first frame from ``start`` outward that is neither torch's, this package's nor the
    checkpoint machinery's: the code a region was entered from."""
    frame = start
    while frame is not None and _kind(frame.f_code) is not _USER:
        frame = frame.f_back
    return frame


def format_site(raw: tuple) -> tuple[str, ...]:
    return tuple(f"{_short_path(c.co_filename)}:{line} in {c.co_name}" for c, line in raw)
