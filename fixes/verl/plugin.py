"""Loading the verl plugin: read the switch and verl's version, arm each patch, log one line."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from fixes.verl import mtp, mtp_recompute, output_discard, reclaim, torchtitan_engine, vllm_refit
from fixes.verl.patch import VerlPatch, left_alone_at_install, logger
from fixes.verl.post_import import when_imported
from fixes.verl.release import KNOWN, verl_version
from fixes.verl.switch import ENV, plugin_enabled

PATCHES: tuple[VerlPatch, ...] = (reclaim.PATCH, output_discard.PATCH, torchtitan_engine.PATCH,
                                  mtp.PATCH, mtp_recompute.PATCH, vllm_refit.PATCH)


@dataclass(frozen=True, slots=True)
class PluginState:
    """What loading did. ``version``: verl's (None: no verl, or the plugin off); ``armed``: the
    patches waiting for (or applied to) their module; ``left_alone``: (patch, why) pairs."""

    version: str | None = None
    armed: tuple[str, ...] = ()
    left_alone: tuple[tuple[str, str], ...] = ()
    off_because: str | None = None


_state: PluginState | None = None


def status() -> PluginState | None:
    """What ``load`` did in this process (None: the plugin was not loaded)."""
    return _state


def _install(patch: VerlPatch, version: str, module) -> None:
    # Runs inside the import of a verl module: a patch that does not fit must not break it.
    try:
        patch.install(module, version)
    except (AttributeError, ImportError, KeyError, TypeError, ValueError) as exc:
        left_alone_at_install(patch.name, version, f"{type(exc).__name__}: {exc}")


def load() -> PluginState:
    """Arm the patches for the verl of this process, once; never raises."""
    global _state
    if _state is not None:
        return _state
    version = verl_version()
    if version is None:  # no verl here: nothing to patch, nothing to say
        _state = PluginState()
        return _state
    try:
        enabled = plugin_enabled()
    except ValueError as exc:  # a typo must not drop the fixes of a whole training run
        logger.error("stackfix verl plugin: %s: kept on (the default)", exc)
        enabled = True
    if not enabled:
        off = f"{ENV}={os.environ[ENV]}"
        logger.warning("stackfix verl plugin: off (%s): verl %s runs without stackfix's fixes",
                       off, version)
        _state = PluginState(off_because=off)
        return _state
    if version not in KNOWN:
        left = tuple((p.name, "unknown release") for p in PATCHES)
        logger.warning("stackfix verl plugin: verl %s is not a release it knows (%s): left alone: "
                       "%s", version, ", ".join(KNOWN), "; ".join(p.name for p in PATCHES))
        _state = PluginState(version=version, left_alone=left)
        return _state
    armed, left = [], []
    for patch in PATCHES:
        why = patch.left_alone(version)
        if why is not None:
            left.append((patch.name, why))
            continue
        when_imported(patch.module, functools.partial(_install, patch, version))
        armed.append(patch.name)
    logger.warning("stackfix verl plugin: verl %s: patched: %s; left alone: %s", version,
                   "; ".join(armed) or "nothing",
                   "; ".join(f"{name} ({why})" for name, why in left) or "nothing")
    _state = PluginState(version=version, armed=tuple(armed), left_alone=tuple(left))
    return _state
