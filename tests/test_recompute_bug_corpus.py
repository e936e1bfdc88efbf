"""The recompute sanitizer against real recompute bugs (``recompute_bugs``: one module per
public upstream report, a buggy and a fixed checkpointed step and the same step without
checkpointing). One contract over the whole corpus:

* the buggy step really diverges from the reference (gradients or the state the report is
  about), so that nothing below passes vacuously;
* under ``recompute_sanitizer(values="all")`` the buggy step, run twice, raises
  ``RecomputeMismatchError`` naming a site on the line the report's recompute departs at (the
  detect tier finds it in the first step, the locator names it in the second) -- or, if it
  does not raise, that run did not diverge;
* the fixed step raises nothing in any values mode, and equals the reference bit for bit.

``test_corpus_census`` counts, per mode, the diverging runs caught, the fixed runs raised on and
the runs the sanitizer crashed (printed; written as JSON to ``$STACKFIX_CORPUS_CENSUS`` when
set)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from recompute_bugs import MODULES, Variant, diverges, load

from fixes.sanitize import RecomputeMismatchError, recompute_sanitizer

pytestmark = [pytest.mark.cpu, pytest.mark.no_stackfix_sanitize]
MODES = ("all", "sampled", "none")


def _bug(name: str):
    bug = load(name)
    for package in bug.requires:
        try:
            missing = importlib.util.find_spec(package) is None
        except ModuleNotFoundError:
            missing = True
        if missing:
            pytest.skip(f"{bug.upstream}: needs {package}, which is not installed")
    return bug


def _names_a_marked_line(error: RecomputeMismatchError, bug) -> bool:
    base = os.path.basename(bug.path)
    wanted = {f"{base}:{n} " for n in bug.diverging_lines()}
    sites = [*error.forward_site, *error.recompute_site]
    return any(os.path.basename(s.split(":", 1)[0]) + ":" + s.split(":", 1)[1].split(" ", 1)[0]
               + " " in wanted for s in sites)


def _sanitized(bug, variant: Variant, mode: str):
    """(error or None, result or None) of two sanitized steps (the detect tier finds a
    divergence in the first; ``values="all"`` locates it in the second), the result the
    first's."""
    try:
        with recompute_sanitizer(values=mode):
            result = bug.step(variant)
            bug.step(variant)
            return None, result
    except RecomputeMismatchError as error:
        return error, None


@pytest.mark.parametrize("name", MODULES)
def test_the_buggy_step_diverges_from_the_reference(name):
    bug = _bug(name)
    reference, buggy = bug.step(Variant.REFERENCE), bug.step(Variant.BUGGY)
    assert diverges(reference, buggy), f"{bug.upstream}: the buggy step equals the reference"
    assert bug.diverging_lines(), f"{bug.path} marks no diverging line"


@pytest.mark.parametrize("name", MODULES)
def test_a_diverging_step_is_named_at_its_line(name):
    bug = _bug(name)
    reference = bug.step(Variant.REFERENCE)
    error, result = _sanitized(bug, Variant.BUGGY, "all")
    if error is None:
        assert not diverges(reference, result), (
            f"{bug.upstream}: the sanitized buggy step diverged "
            f"({diverges(reference, result)}) and nothing was raised")
        return
    assert _names_a_marked_line(error, bug), (
        f"{bug.upstream}: no site on lines {bug.diverging_lines()} of {bug.path}: "
        f"{error.forward_site} / {error.recompute_site}\n{error}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODULES)
def test_the_fixed_step_raises_nothing(name, mode):
    bug = _bug(name)
    reference = bug.step(Variant.REFERENCE)
    error, result = _sanitized(bug, Variant.FIXED, mode)
    assert error is None, f"{bug.upstream}: false alarm on the fixed step ({mode}): {error}"
    assert not diverges(reference, result), (
        f"{bug.upstream}: the fixed step differs from the reference: "
        f"{diverges(reference, result)}")


def _counted(bug, variant: Variant, mode: str):
    """(RecomputeMismatchError or None, any other exception's repr or None) of one run."""
    try:
        return _sanitized(bug, variant, mode)[0], None
    except Exception as exc:  # the sanitizer crashing the user's step: counted, then failed
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def _what(error: RecomputeMismatchError | None) -> str | None:
    if error is None:
        return None
    return f"{getattr(error, 'verdict', '-')} / {error.what} / {error.op}"


def test_corpus_census():
    """Per mode: buggy runs that diverge from the reference and were caught; fixed runs
    raised on. The contract holds in every mode for the fixed runs and in ``all`` for the
    buggy ones; the other modes' catches are counted, not required."""
    census = {mode: {"diverging": 0, "caught": 0, "fixed_runs": 0, "false_alarms": 0,
                     "crashed": 0} for mode in MODES}
    rows = []
    for name in MODULES:
        try:
            bug = _bug(name)
        except pytest.skip.Exception:
            continue
        reference = bug.step(Variant.REFERENCE)
        diverged = bool(diverges(reference, bug.step(Variant.BUGGY)))
        for mode in MODES:
            error, crash = _counted(bug, Variant.BUGGY, mode)
            census[mode]["diverging"] += diverged
            census[mode]["caught"] += diverged and error is not None
            fixed_error, fixed_crash = _counted(bug, Variant.FIXED, mode)
            census[mode]["fixed_runs"] += 1
            census[mode]["false_alarms"] += fixed_error is not None
            census[mode]["crashed"] += (crash is not None) + (fixed_crash is not None)
            rows.append({"bug": bug.upstream, "mode": mode, "diverges": diverged,
                         "caught": error is not None, "what": _what(error), "crash": crash,
                         "false_alarm": fixed_error is not None, "on_fixed": _what(fixed_error),
                         "fixed_crash": fixed_crash})
    print(json.dumps(census, indent=1))
    if path := os.environ.get("STACKFIX_CORPUS_CENSUS"):
        with open(path, "w") as f:
            json.dump({"census": census, "runs": rows}, f, indent=1)
    assert census["all"]["caught"] == census["all"]["diverging"]
    assert all(census[m]["false_alarms"] == 0 and census[m]["crashed"] == 0 for m in MODES)
