"""The on/off environment switches of stackfix (``STACKFIX_VERL_PLUGIN``, and the harness's
``STACKFIX_FORKSERVER`` and ``STACKFIX_SANITIZE``), read one way: the usual spellings of on and
off in any case, and for anything else a ValueError naming the variable, its value and the
spellings allowed. What a caller does with a bad value is its own (the verl plugin keeps its
default and logs it; the harness stops)."""

from __future__ import annotations

import os
from collections.abc import Mapping

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
SPELLINGS = (f"on is {', '.join(ON[:-1])} or {ON[-1]}; "
             f"off is {', '.join(OFF[:-1])} or {OFF[-1]} (any case)")


def on_off(value: str) -> bool | None:
    """True / False for a spelling of on / off (blanks around it aside); None for anything else."""
    value = value.strip().lower()
    return True if value in ON else False if value in OFF else None


def env_switch(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """The switch ``name`` in ``environ``: ``default`` when unset or empty, else its on/off value;
    ValueError naming the allowed spellings for any other value."""
    value = environ.get(name, "")
    if not value.strip():
        return default
    state = on_off(value)
    if state is None:
        raise ValueError(f"{name}={value!r} is not an on/off value: {SPELLINGS}")
    return state
