"""Run a repro's unfixed and fixed paths in child interpreters and judge each outcome."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from repro.harness.isolated import IsolatedResult, run_isolated
from repro.registry import Repro, reported_exception


@dataclass
class PathOutcome:
    """One path (unfixed or fixed) of one repro on one device."""

    status: str  # reproduced | not-reproduced | wrong-failure | passed | failed | skipped
    detail: str
    seconds: float

    @property
    def good(self) -> bool:
        return self.status in ("reproduced", "passed", "skipped")


@dataclass
class ReproOutcome:
    name: str
    device: str
    unfixed: PathOutcome
    fixed: PathOutcome

    @property
    def good(self) -> bool:
        return self.unfixed.good and self.fixed.good

    def as_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "good": self.good,
                "unfixed": asdict(self.unfixed), "fixed": asdict(self.fixed)}


def run_path(repro: Repro, fixed: bool, device: str) -> IsolatedResult:
    """The raw child result of one path (tests assert on it directly)."""
    mode = "--fixed" if fixed else "--unfixed"
    return run_isolated(
        module="repro.child", args=[repro.name, mode, "--device", device], timeout=repro.timeout
    )


def _failure_text(result: IsolatedResult) -> str:
    exc = reported_exception(result.stderr)
    if exc is not None:
        message = " ".join(exc["message"].split())  # one table row: no embedded newlines
        if len(message) > 160:
            message = message[:159] + "…"
        return f"{exc['types'][0]}: {message}"
    if result.signal is not None or result.timed_out:
        return result.describe()
    tail = result.stderr.strip().splitlines()[-1:] or [""]
    return f"{result.describe()}: {tail[0][:160]}"


def judge_unfixed(repro: Repro, result: IsolatedResult, device: str) -> PathOutcome:
    sig = repro.matching_signature(result, device)
    if sig is not None:
        return PathOutcome("reproduced", _failure_text(result), result.seconds)
    if result.ok:
        return PathOutcome("not-reproduced", "unfixed path completed", result.seconds)
    expected = " | ".join(s.describe() for s in repro.signatures if device in s.devices)
    return PathOutcome(
        "wrong-failure", f"{_failure_text(result)} (expected {expected})", result.seconds
    )


def judge_fixed(result: IsolatedResult) -> PathOutcome:
    if result.ok:
        return PathOutcome("passed", "completed", result.seconds)
    return PathOutcome("failed", _failure_text(result), result.seconds)


def run_repro(repro: Repro, device: str) -> ReproOutcome:
    """Both paths of ``repro`` on ``device``; skipped (with the reason) when it cannot run."""
    reason = None
    if device not in repro.devices:
        reason = f"no {device} variant"
    elif missing := repro.missing_requirements():
        reason = "missing " + ", ".join(missing)
    if reason is not None:
        skip = PathOutcome("skipped", reason, 0.0)
        return ReproOutcome(repro.name, device, skip, skip)
    unfixed = judge_unfixed(repro, run_path(repro, False, device), device)
    fixed = judge_fixed(run_path(repro, True, device))
    return ReproOutcome(repro.name, device, unfixed, fixed)
