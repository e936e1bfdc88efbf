"""Run a repro's unfixed and fixed paths in child interpreters and judge each outcome."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from repro.catalog import Entry
from repro.harness.isolated import IsolatedResult, run_isolated
from repro.harness.optional import torch_conflict
from repro.harness.sanitize import ENV as SANITIZE_ENV
from repro.registry import DECLARED_IN, SKIP_EXIT_CODE, Repro, reported_exception, reported_skip

# Path statuses. Only these two are good; "skipped" never is.
GOOD_UNFIXED, GOOD_FIXED = "reproduced", "passed"


@dataclass
class PathOutcome:
    """One path (unfixed or fixed) of one repro on one device. ``detail`` is the full text
    (the exception message, the skip reason); the table shortens it, the JSON keeps it."""

    status: str  # reproduced | not-reproduced | wrong-failure | passed | failed | skipped
    detail: str
    seconds: float
    # The part of ``detail`` that identifies it: the message or stderr fragment the matched
    # signature names (the table keeps it when it shortens the detail). Empty: none.
    key: str = ""


@dataclass
class ReproOutcome:
    name: str
    device: str
    unfixed: PathOutcome
    fixed: PathOutcome
    sanitized: bool = False  # both paths ran under fixes.sanitize (python -m repro --sanitize)

    @property
    def status(self) -> str:
        """``good`` (reproduced unfixed, passed fixed), ``bad`` (anything else that ran), or
        ``skipped`` (a path could not run and nothing that ran was bad)."""
        paths = (self.unfixed, self.fixed)
        if any(p.status not in (GOOD_UNFIXED, GOOD_FIXED, "skipped") for p in paths):
            return "bad"
        if any(p.status == "skipped" for p in paths):
            return "skipped"
        return "good"

    def as_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "status": self.status,
                "sanitized": self.sanitized,
                "unfixed": asdict(self.unfixed), "fixed": asdict(self.fixed)}


def run_path(repro: Repro, fixed: bool, device: str, sanitized: bool = False) -> IsolatedResult:
    """The raw child result of one path (tests assert on it directly); ``sanitized`` runs it
    (and the ranks it starts) under the fixes.sanitize sanitizers the repro declares. The child is forked from the
    fork server profile the repro names (torch preloaded), or spawned where it names none."""
    mode = "--fixed" if fixed else "--unfixed"
    declared = DECLARED_IN.get(repro.name)
    where = ["--module", declared] if declared else []
    return run_isolated(
        module="repro.child", args=[repro.name, mode, "--device", device, *where],
        timeout=repro.timeout,
        env={SANITIZE_ENV: ",".join(repro.sanitizers) if sanitized else "0"},
        forkserver=repro.forkserver or False,
    )


def failure_text(result: IsolatedResult) -> str:
    """What went wrong in a child, in full: ``Type: message``, the signal, or the last line."""
    exc = reported_exception(result.stderr)
    if exc is not None:
        return f"{exc['types'][0]}: {exc['message']}"
    if result.signal is not None or result.timed_out:
        return result.describe()
    tail = result.stderr.strip().splitlines()[-1:] or [""]
    return f"{result.describe()}: {tail[0]}"


def _skipped(result: IsolatedResult) -> PathOutcome | None:
    reason = reported_skip(result.stderr)
    if result.returncode == SKIP_EXIT_CODE and reason is not None:
        return PathOutcome("skipped", reason, result.seconds)
    return None


def judge_unfixed(
    repro: Repro, result: IsolatedResult, device: str, sanitized: bool = False
) -> PathOutcome:
    if (skip := _skipped(result)) is not None:
        return skip
    sig = repro.matching_signature(result, device, sanitized)
    if sig is not None:
        return PathOutcome("reproduced", failure_text(result), result.seconds,
                           key=sig.message or sig.stderr or "")
    if result.ok:
        return PathOutcome("not-reproduced", "unfixed path completed", result.seconds)
    expected = " | ".join(
        s.describe() for s in repro.expected_signatures(sanitized) if device in s.devices
    )
    return PathOutcome(
        "wrong-failure", f"{failure_text(result)} (expected {expected})", result.seconds
    )


def judge_fixed(result: IsolatedResult) -> PathOutcome:
    if (skip := _skipped(result)) is not None:
        return skip
    if result.ok:
        return PathOutcome("passed", "completed", result.seconds)
    return PathOutcome("failed", failure_text(result), result.seconds)


def skip_reason(repro: Repro | Entry, device: str) -> str | None:
    """Why ``repro`` (or its catalog entry) cannot run on ``device`` here, known before
    starting it (no child is started); None if it can."""
    if device not in repro.devices:
        return f"no {device} variant"
    if missing := repro.missing_requirements():
        return "missing " + ", ".join(missing)
    for module in repro.requires:  # installed, on a torch older than it needs (no import)
        if conflict := torch_conflict(module.split(".")[0]):
            return conflict
    return repro.unmet_precondition()


def skipped_outcome(name: str, device: str, reason: str, sanitized: bool = False) -> ReproOutcome:
    skip = PathOutcome("skipped", reason, 0.0)
    return ReproOutcome(name, device, skip, skip, sanitized)


def run_repro(repro: Repro, device: str, sanitized: bool = False) -> ReproOutcome:
    """Both paths of ``repro`` on ``device``; skipped (with the reason) when it cannot run.
    ``sanitized``: under fixes.sanitize, judged by the repro's sanitized signatures."""
    reason = skip_reason(repro, device)
    if reason is not None:
        return skipped_outcome(repro.name, device, reason, sanitized)
    unfixed = judge_unfixed(repro, run_path(repro, False, device, sanitized), device, sanitized)
    fixed = judge_fixed(run_path(repro, True, device, sanitized))
    return ReproOutcome(repro.name, device, unfixed, fixed, sanitized)
