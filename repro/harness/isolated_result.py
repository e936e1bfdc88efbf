"""What a child process did (``IsolatedResult``): the one type the fork server
(repro.harness.forkserver) and the spawning path (repro.harness.isolated) both build. A leaf:
it imports nothing of this repository."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class IsolatedResult:
    """What a child interpreter did: its exit code or the signal that killed it, and its output."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    @property
    def signal(self) -> int | None:
        """The signal number that ended the child (None if it exited or timed out)."""
        if self.returncode is not None and self.returncode < 0:
            return -self.returncode
        return None

    @property
    def signal_name(self) -> str | None:
        sig = self.signal
        if sig is None:
            return None
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"SIG{sig}"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        if self.timed_out:
            return f"timed out after {self.seconds:.0f}s"
        if self.signal is not None:
            return f"killed by {self.signal_name}"
        return f"exit {self.returncode}"
