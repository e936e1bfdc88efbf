"""Installing a wrapper around a checkpoint Function's own ``backward``, and saying what is
installed: the machinery under ``fixes.megatron.apply_recompute_reclaim_patch`` (and the
harness's unfixed reclaims, which install the same way).

The wrapper always wraps the module's *own* backward (``fixes.megatron.pristine``). A backward
someone else assigned before the install (verl's ``apply_patch_megatron_recomputation_backward``
does, in its engine's init) is replaced with a ``RuntimeWarning`` naming it; one assigned
*after* the install is named by a ``RuntimeWarning`` at the next checkpoint call (the install
also wraps ``forward`` to see it). ``installed_reclaim()`` reports what is installed *now*.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable

from fixes.megatron.pristine import describe, is_own_backward, own_backward, remember_own_backward

__all__ = ["default_target", "install_backward_wrapper", "installed_reclaim", "reset_backward",
           "uninstall_backward_wrapper"]

_MARK = "__stackfix_reclaim__"
_install_lock = threading.Lock()
# target -> the forward that was in place when a stackfix reclaim was installed
_forwards: dict[type, staticmethod] = {}
_named: set[tuple[type, int]] = set()  # (target, id of a backward) already named in a warning


def default_target() -> type:
    """megatron-core's ``tensor_parallel.random.CheckpointFunction`` (imported on first use)."""
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom.CheckpointFunction


def _current(target: type) -> Callable | None:
    current = target.__dict__.get("backward")
    return getattr(current, "__func__", current)


def installed_reclaim(target: type | None = None) -> str | None:
    """What ``target.backward`` (megatron's CheckpointFunction by default) is *now*: a stackfix
    reclaim's kind (``PATCH_KIND``), None for the module's own backward, or
    ``"foreign:<module.qualname (file:line)>"`` for anything else (verl's reclaim, say)."""
    target = default_target() if target is None else target
    remember_own_backward(target)
    fn = _current(target)
    kind = getattr(fn, _MARK, None)
    if kind is not None:
        return kind
    return None if is_own_backward(target, fn) else f"foreign:{describe(fn)}"


def _watching(target: type, forward: Callable, kind: str) -> Callable:
    """``forward`` that names, once, a backward assigned over the ``kind`` reclaim."""

    @functools.wraps(forward)
    def forward_watching_backward(ctx, *args, **kwargs):
        current = _current(target)
        if getattr(current, _MARK, None) != kind and (target, id(current)) not in _named:
            _named.add((target, id(current)))
            warnings.warn(
                f"{target.__module__}.{target.__qualname__}.backward was replaced by "
                f"{describe(current)} after stackfix's {kind} reclaim was installed: that "
                "backward runs now, not stackfix's (verl's reclaim resize_(0)s checkpoint "
                "inputs; a chunk view shared with another reader then reads freed memory, "
                "verl #7328). Apply the reclaim after it (apply_recompute_reclaim_patch) or "
                "install the verl plugin, which keeps verl from assigning it.",
                RuntimeWarning, stacklevel=3)
        return forward(ctx, *args, **kwargs)

    setattr(forward_watching_backward, _MARK, kind)
    return forward_watching_backward


def install_backward_wrapper(
    kind: str, make_wrapper: Callable[[Callable], Callable], target: type | None = None
) -> bool:
    """Install ``make_wrapper(own_backward)`` on ``target`` (megatron's CheckpointFunction by
    default), where ``own_backward`` is the module's own, whatever is installed now: another
    stackfix reclaim is replaced; a foreign backward is replaced with a ``RuntimeWarning``
    naming it. ``target.forward`` is wrapped to name a backward assigned later. False if
    ``kind`` is already what is installed (idempotent)."""
    target = default_target() if target is None else target
    with _install_lock:
        current = _current(target)
        if getattr(current, _MARK, None) == kind:
            return False
        own = own_backward(target).__func__  # TypeError / RuntimeError before any change
        if getattr(current, _MARK, None) is None and not is_own_backward(target, current):
            warnings.warn(
                f"{target.__module__}.{target.__qualname__}.backward was replaced by "
                f"{describe(current)}; the {kind} reclaim replaces it and wraps the module's own "
                "backward instead", RuntimeWarning, stacklevel=3)
        wrapper = make_wrapper(own)
        setattr(wrapper, _MARK, kind)
        target.backward = staticmethod(wrapper)
        forward = target.__dict__["forward"]
        if getattr(forward.__func__, _MARK, None) is not None:  # another reclaim's watcher
            forward = _forwards[target]
        _forwards[target] = forward
        target.forward = staticmethod(_watching(target, forward.__func__, kind))
        return True


def _restore(target: type) -> None:
    target.backward = own_backward(target)
    forward = target.__dict__.get("forward")
    if target in _forwards and getattr(getattr(forward, "__func__", None), _MARK, None):
        target.forward = _forwards.pop(target)


def uninstall_backward_wrapper(kind: str, target: type | None = None) -> bool:
    """Put the module's own backward (and forward) back if ``kind`` is what is installed; else
    False."""
    target = default_target() if target is None else target
    with _install_lock:
        if getattr(_current(target), _MARK, None) != kind:
            return False
        _restore(target)
        return True


def reset_backward(target: type | None = None) -> str | None:
    """Put the module's own backward back, whatever is installed (a stackfix reclaim or a
    foreign one); returns what was installed, as ``installed_reclaim`` says it."""
    target = default_target() if target is None else target
    with _install_lock:
        was = installed_reclaim(target)
        if was is not None:
            _restore(target)
        return was
