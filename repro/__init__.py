"""stackfix repros: each crash reproduced minimally, unfixed vs fixed, in child processes.

Add a repro: a module ``repro/<name>.py`` with ``REPROS = [Repro(name=..., summary=...,
run=<run(fixed, device)>, signatures=(Signature(...),), devices=(...))]``."""

from repro.harness.isolated import IsolatedResult, run_isolated
from repro.registry import Repro, Signature, Skipped, WrongResult, discover

__all__ = [
    "IsolatedResult", "Repro", "Signature", "Skipped", "WrongResult", "discover", "run_isolated",
]
