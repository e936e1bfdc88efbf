"""The harness's environment variables, checked before anything runs: ``python -m repro`` and
the test suite (tests/conftest.py) stop at once on a bad value, naming what is allowed, instead
of a child failing on it later.

- ``STACKFIX_FORKSERVER``: an on/off value (repro.harness.forkserver);
- ``STACKFIX_SANITIZE``: an on/off value or a list of sanitizers (repro.harness.sanitize);
- ``STACKFIX_MEGATRON_LM``: a Megatron-LM dev checkout (repro.harness.megatron_lm).
"""

from __future__ import annotations

from repro.harness import forkserver, megatron_lm, sanitize


def problems() -> list[str]:
    """One line per variable whose value the harness cannot use (empty: all fine)."""
    found = []
    for check in (forkserver.enabled, sanitize.requested):
        try:
            check()
        except ValueError as exc:
            found.append(str(exc))
    if (why := megatron_lm.configured_checkout_error()) is not None:
        found.append(why)
    return found
