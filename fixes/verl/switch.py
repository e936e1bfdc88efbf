"""``STACKFIX_VERL_PLUGIN``: the one switch of the verl plugin, on unless set to an off value
(``fixes.switch``: 0, false, no, off in any case)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from fixes.switch import env_switch

ENV = "STACKFIX_VERL_PLUGIN"


def plugin_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """False for an off value of ``STACKFIX_VERL_PLUGIN``, True when it is unset, empty or on;
    ValueError naming the allowed spellings for any other value."""
    return env_switch(ENV, True, environ)
