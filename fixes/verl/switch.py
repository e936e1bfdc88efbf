"""``STACKFIX_VERL_PLUGIN``: the one switch of the verl plugin (unset or ``1``: on; ``0``: off)."""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "STACKFIX_VERL_PLUGIN"
ALLOWED = {"1": True, "0": False}


def plugin_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """True unless ``STACKFIX_VERL_PLUGIN=0``; ValueError naming the allowed values otherwise."""
    value = environ.get(ENV, "").strip()
    if value == "":
        return True
    if value not in ALLOWED:
        raise ValueError(f"{ENV}={value!r} is not one of {sorted(ALLOWED)} "
                         "(1: on, the default; 0: off)")
    return ALLOWED[value]
