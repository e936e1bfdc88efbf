"""What a repro declares, how the runner finds them, and how an outcome is matched.

A repro module under ``repro/`` exposes ``REPROS: list[Repro]``. Each Repro names a
function ``run(fixed: bool, device: str) -> None`` that performs the scenario in-process;
the runner always calls it in a child process (``python -m repro.child``, forked from the fork
server or spawned, as the Repro's ``forkserver`` says), so a segfault or a CUDA fault ends that
child only.

Adding a repro: create ``repro/<name>.py`` with ``run(fixed, device)`` (raise ``WrongResult``
when a completed run gives a wrong answer) and ``REPROS = [Repro(name=..., summary=..., run=run,
devices=("cpu",), signatures=(Signature(exception="RuntimeError", message="..."),))]``, then
regenerate the runner's catalog, ``python -m repro.catalog`` (``repro/catalog.json``: what
``--list``, argument checks and pre-start skips read without importing torch;
tests/test_cli_imports.py fails while it is out of date). A check that needs no child (an
environment variable, a checkout) goes in ``precondition=``. ``tests/test_repros.py`` then gates
it (unfixed reproduces a signature, fixed passes) with no further code; declare
``sanitized_signatures`` when ``fixes.sanitize`` names the fault earlier. A repro that starts rank
processes runs each rank inside ``repro.harness.ranks.reporting_rank()`` and calls
``raise_for_ranks(ranks)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import signal as _signal
from collections.abc import Callable
from dataclasses import dataclass, field

from repro.harness.sanitize import NAMES as SANITIZER_NAMES

DEVICES = ("cpu", "cuda")
EXCEPTION_MARKER = "REPRO-EXCEPTION "
SKIP_MARKER = "REPRO-SKIPPED "
# With STACKFIX_CHILD_TIMES=1 a child that ends by itself prints, on stdout, when it entered
# main, had imported the repro's module and ended its run (time.time(); benchmarks/child_phases.py).
TIMES_ENV = "STACKFIX_CHILD_TIMES"
TIMES_MARKER = "REPRO-TIMES "
SKIP_EXIT_CODE = 77  # the child's exit status for "could not run here" (automake's skip code)


class Skipped(Exception):
    """Raised by a repro that cannot run here (a package, checkout or GPU it needs is missing).
    The message is the reason; the runner reports the path as skipped, never as good."""


class ReportedFailure(Exception):
    """An exception another process (a rank of a multi-process repro) reported; the child
    passes that report on as its own, so signatures match the original exception."""

    def __init__(self, report: dict, where: str):
        self.report = report
        super().__init__(f"{where}: {report['types'][0]}: {report['message']}")


class WrongResult(AssertionError):
    """Raised by a repro's oracle when the run completed but its result is wrong
    (e.g. gradients that differ from the reference): the silent variant of a crash."""


@dataclass(frozen=True)
class Signature:
    """One acceptable way for the unfixed path to fail.

    ``exception`` matches a class name anywhere in the raised exception's MRO,
    ``message`` a fragment of its text, ``signal`` the signal that killed the child,
    ``stderr`` a fragment of the child's stderr (for errors reported asynchronously,
    such as CUDA faults). Every field given must match. ``devices`` limits where it applies.
    """

    exception: str | None = None
    message: str | None = None
    signal: int | None = None
    stderr: str | None = None
    devices: tuple[str, ...] = DEVICES

    def __post_init__(self):
        if not (self.exception or self.message or self.signal or self.stderr):
            raise ValueError("a Signature needs at least one of exception, message, signal, stderr")
        bad = set(self.devices) - set(DEVICES)
        if bad:
            raise ValueError(f"unknown devices {sorted(bad)}; allowed: {DEVICES}")

    def describe(self) -> str:
        parts = []
        if self.signal:
            parts.append(_signal.Signals(self.signal).name)
        if self.exception:
            parts.append(self.exception)
        if self.message:
            parts.append(repr(self.message))
        if self.stderr:
            parts.append(f"stderr~{self.stderr!r}")
        return " ".join(parts)

    def matches(self, result, device: str) -> bool:
        """True if ``result`` (an IsolatedResult from the child) is this failure."""
        if device not in self.devices or result.timed_out or result.returncode == 0:
            return False
        if self.signal is not None and result.signal != self.signal:
            return False
        if self.stderr is not None and self.stderr not in result.stderr:
            return False
        if self.exception is not None or self.message is not None:
            exc = reported_exception(result.stderr)
            if exc is None:
                return False
            if self.exception is not None and self.exception not in exc["types"]:
                return False
            if self.message is not None and self.message not in exc["message"]:
                return False
        return True


def exception_report(exc: BaseException) -> str:
    """The JSON a child or rank prints after EXCEPTION_MARKER: the class names of the
    exception's MRO and its message (a ReportedFailure passes on the report it carries)."""
    if isinstance(exc, ReportedFailure):
        return json.dumps(exc.report)
    return json.dumps({"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)})


def reported_skip(stderr: str) -> str | None:
    """The reason the child gave for skipping (last marker line), or None."""
    for line in reversed(stderr.splitlines()):
        if line.startswith(SKIP_MARKER):
            return line[len(SKIP_MARKER) :]
    return None


def reported_exception(stderr: str) -> dict | None:
    """The exception the child reported (last marker line), or None."""
    for line in reversed(stderr.splitlines()):
        if line.startswith(EXCEPTION_MARKER):
            return json.loads(line[len(EXCEPTION_MARKER) :])
    return None


@dataclass(frozen=True)
class Repro:
    """A crash reproduced minimally: unfixed must fail with one of ``signatures``,
    fixed must complete (its own oracle raises WrongResult on a wrong answer)."""

    name: str
    summary: str
    run: Callable[[bool, str], None]
    signatures: tuple[Signature, ...]
    devices: tuple[str, ...] = ("cpu",)
    requires: tuple[str, ...] = ()  # importable modules the scenario needs
    timeout: float = 300.0
    upstream: str = ""  # the upstream issue / PR it comes from
    # How the unfixed path fails under ``python -m repro --sanitize`` (fixes.sanitize names the
    # fault first, e.g. ReleasedStorageError instead of SIGSEGV). Empty: as without it.
    sanitized_signatures: tuple[Signature, ...] = ()
    # The fixes.sanitize sanitizers both paths run under then (repro.harness.sanitize.NAMES).
    sanitizers: tuple[str, ...] = ("storage", "mesh")
    # The fork server profile its children are forked from (repro.harness.forkserver.PRELOADS:
    # what is imported before the child starts); None: a fresh interpreter, for a child that
    # imports a package the server preloads from elsewhere.
    forkserver: str | None = "torch"
    # A cheap check the parent runs before starting any child: returns why the repro cannot run
    # here (e.g. repro.harness.megatron_lm.skip_reason: STACKFIX_MEGATRON_LM unset) or None. It
    # must import nothing heavy; repro/catalog.json records it as "module:function".
    precondition: Callable[[], str | None] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        bad = set(self.devices) - set(DEVICES)
        if bad:
            raise ValueError(f"repro {self.name!r}: unknown devices {sorted(bad)}; allowed: {DEVICES}")
        if not self.signatures:
            raise ValueError(f"repro {self.name!r} declares no failure signature")
        if not self.sanitizers or set(self.sanitizers) - set(SANITIZER_NAMES):
            raise ValueError(f"repro {self.name!r}: sanitizers must be a non-empty subset of "
                             f"{SANITIZER_NAMES}; got {self.sanitizers}")

    def missing_requirements(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m.split(".")[0]) is None]

    def unmet_precondition(self) -> str | None:
        return self.precondition() if self.precondition is not None else None

    def expected_signatures(self, sanitized: bool = False) -> tuple[Signature, ...]:
        return (self.sanitized_signatures or self.signatures) if sanitized else self.signatures

    def matching_signature(self, result, device: str, sanitized: bool = False) -> Signature | None:
        for sig in self.expected_signatures(sanitized):
            if sig.matches(result, device):
                return sig
        return None


# The runner's own modules (and the ``harness`` package, skipped as a package): no repros there.
_RUNNER_MODULES = frozenset({"catalog", "child", "registry", "runner", "testing"})


def discover() -> dict[str, Repro]:
    """Every Repro declared by a public module of the ``repro`` package, by name."""
    import repro as package

    found: dict[str, Repro] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg or info.name in _RUNNER_MODULES:
            continue
        module = importlib.import_module(f"repro.{info.name}")
        for r in getattr(module, "REPROS", ()):
            if r.name in found:
                raise ValueError(f"repro name {r.name!r} declared twice")
            found[r.name] = r
            DECLARED_IN[r.name] = module.__name__
    return found


# repro name -> the module that declares it (filled by ``discover``): a child imports only that.
DECLARED_IN: dict[str, str] = {}


def find(name: str, module: str | None = None) -> Repro:
    """The repro ``name``; from ``module`` alone when given (a child need not import every repro
    module and what each imports), else from ``discover()``."""
    if module is not None:
        for r in getattr(importlib.import_module(module), "REPROS", ()):
            if r.name == name:
                DECLARED_IN[name] = module
                return r
        raise KeyError(f"{module} declares no repro {name!r}")
    return discover()[name]
