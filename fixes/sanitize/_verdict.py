"""Whether a recompute computed what its forward did, where backward would use it -- the
verdict -- and the error that says where it did not.

Compared, forward against recompute, at the end of the recompute:

* non-reentrant regions (the forward saved tensors for backward: ``_saved``): how many tensors
  were saved, and each saved tensor's metadata and fingerprint;
* reentrant regions (torch's ``use_reentrant=True``, megatron-core's ``CheckpointFunction`` and
  ``CheckpointWithoutOutput``: the forward runs without grad and saves nothing, backward
  differentiates the recompute's outputs): each output's metadata and fingerprint;
* both: the tensors outside the region the recompute left changed (``_outside``).

Ops that differ while all of these are equal are no error: a cache built on first use, hooks
that run in the forward only, an op lowered differently with grad on. When the verdict finds a
difference, the op streams locate where the recompute departs from its forward (``_locate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fixes.sanitize import _fingerprint as fp
from fixes.sanitize._callsite import describe_site
from fixes.sanitize._errors import Divergence, RecomputeMismatchError, Verdict
from fixes.sanitize._locate import Alignment, Location, describe_meta
from fixes.sanitize._opsite import format_site
from fixes.sanitize._outside import Written

_WHY = ("so gradients would be computed from other values than the loss was (state changed "
        "between forward and backward, a lost mesh skipping a collective, an RNG state not "
        "restored, a context the recompute does not re-enter)")


@dataclass(slots=True)
class Finding:
    verdict: Verdict
    item: str
    detail: str
    location: Location
    written: list[Written] | None = None  # side effects: the tensors to give back


_NO_STREAM = Location(Divergence.UNLOCATED, None, None,
                      "values='none' keeps no op stream; values='all' locates the first op "
                      "that differs")


def _locate(alignment: Alignment, replay) -> Location:
    return _NO_STREAM if replay.light else alignment.locate(replay.sampled)


def _first(pairs: list) -> int | None:
    """The first index whose (forward, recompute) metadata or, where both were fingerprinted,
    values differ."""
    for i, (f_meta, r_meta, _, _) in enumerate(pairs):
        if f_meta != r_meta:
            return i
    printed = [(i, a, b) for i, (_, _, a, b) in enumerate(pairs) if a is not None and b is not None]
    found = fp.first_different([(a, b) for _, a, b in printed])
    return None if found is None else printed[found][0]


def saved_finding(forward, replay, alignment: Alignment) -> Finding | None:
    f_entries, r_entries = forward.saved.entries, replay.saved.entries
    if len(r_entries) < len(f_entries) and not replay.stopped_early:
        location = _locate(alignment, replay)
        return Finding(Verdict.SAVED_COUNT, f"saved tensor #{len(r_entries)}",
                       f"the forward saved {len(f_entries)} tensors for backward, the "
                       f"recompute {len(r_entries)}", location)
    pairs = [(f.meta, r.meta, f.print if f.valued else None, r.print if r.valued else None)
             for f, r in zip(f_entries, r_entries, strict=False)]
    index = _first(pairs)
    if index is None:
        return None
    f, r = f_entries[index], r_entries[index]
    if f.meta != r.meta:
        detail = f"forward {describe_meta(f.meta)}, recompute {describe_meta(r.meta)}"
    else:
        detail = f"other values: forward {fp.describe(f.print)}, recompute {fp.describe(r.print)}"
    location = None
    if f.written_at is not None and replay.stopped_early:
        location = alignment.early_stop(f.written_at)
    if location is None:
        location = _locate(alignment, replay)
    where = "" if replay.light else f", saved {_between(forward.stream.records, f.position)}"
    item = f"saved tensor #{index} of {len(f_entries)} ({describe_meta(f.meta)[1:-1]}{where})"

    return Finding(Verdict.SAVED_TENSOR, item, detail, location)


def _between(records, position: int) -> str:
    before = records[position - 1] if position > 0 else None
    if before is None:
        return "before the region's first op"
    return (f"after op #{position - 1} {before.op} at "
            f"{describe_site(format_site(before.site)[:1])}")


def output_finding(forward, replay, alignment: Alignment) -> Finding | None:
    f_outs, r_outs = forward.outputs, replay.outputs
    if len(f_outs) != len(r_outs):
        return Finding(Verdict.OUTPUT, "the outputs",
                       f"the forward returned {len(f_outs)} tensors, the recompute "
                       f"{len(r_outs)}", _locate(alignment, replay))
    index = _first([(a[0], b[0], a[1], b[1]) for a, b in zip(f_outs, r_outs, strict=True)])
    if index is None:
        return None
    (f_meta, f_print, _), (r_meta, r_print, _) = f_outs[index], r_outs[index]
    location = _locate(alignment, replay)
    if (alignment.is_lowering(location)
            and all(a[0] == b[0] for a, b in zip(f_outs, r_outs, strict=True))
            and _first([(a[0], b[0], a[2], b[2]) for a, b in zip(f_outs, r_outs, strict=True)])
            is None):
        replay.region.stats.lowerings_accepted += 1  # within the tolerance: no difference
        return None
    if f_meta != r_meta:
        detail = f"forward {describe_meta(f_meta)}, recompute {describe_meta(r_meta)}"
    else:
        detail = f"other values: forward {fp.describe(f_print)}, recompute {fp.describe(r_print)}"
    return Finding(Verdict.OUTPUT, f"output #{index} of {len(f_outs)} "
                   f"({describe_meta(f_meta)[1:-1]})", detail, location)


def side_effect_finding(forward, replay, alignment: Alignment) -> Finding | None:
    changed = replay.outside.left_changed(forward.updates)
    if not changed:
        return None
    w = changed[0]
    shape = f"shape {list(w.tensor.shape)}, {str(w.tensor.dtype).removeprefix('torch.')}"
    detail = (f"{w.op} writes its argument {w.argument!r} ({shape}), a tensor that lives outside "
              "the region (a module buffer, parameter, attribute or the region's input), and "
              "the recompute leaves it changed, so the forward's update would be applied a "
              "second time")
    more = f"; {len(changed) - 1} more such tensors" if len(changed) > 1 else ""
    at = None if replay.light else w.position  # ``none``: no op stream, no position
    location = Location(Divergence.SIDE_EFFECT,
                        alignment.forward_of(w.position) if w.recorded and at is not None
                        else None, at, detail + more, op=w.op, recompute_site=w.site)
    return Finding(Verdict.SIDE_EFFECT, f"a tensor outside the region ({shape})", detail,
                   location, written=changed)


def _order(finding: Finding) -> tuple:
    loc = finding.location
    position = loc.recompute if loc.recompute is not None else (loc.forward or 0)
    return (position, finding.verdict is not Verdict.SIDE_EFFECT)


def judge(forward, replay) -> Finding | None:
    """The first difference of ``replay`` from ``forward`` (``_region`` sides) in what backward
    uses, located; None if there is none."""
    alignment = Alignment(forward.stream.records, replay.stream.records, replay.stopped_early)
    findings = [side_effect_finding(forward, replay, alignment)]
    if forward.region.reentrant:
        findings.append(output_finding(forward, replay, alignment))
    else:
        findings.append(saved_finding(forward, replay, alignment))
    findings = [f for f in findings if f is not None]
    return min(findings, key=_order) if findings else None


def raise_for(finding: Finding, region, forward, replay) -> None:
    """Give outside tensors their contents back and raise the finding's error."""
    if finding.written:
        replay.outside.restore(finding.written)
    loc = finding.location
    f_rec = forward.stream.records[loc.forward] if loc.forward is not None else None
    r_rec = (replay.stream.records[loc.recompute] if loc.recompute is not None
             and loc.recompute < len(replay.stream.records) else None)
    forward_site = format_site(f_rec.site) if f_rec is not None else ()
    if loc.recompute_site is not None:
        recompute_site = format_site(loc.recompute_site)
    else:
        recompute_site = format_site(r_rec.site) if r_rec is not None else ()
    if loc.op is not None:
        op = str(loc.op)
    else:
        op = str(r_rec.op if r_rec is not None else f_rec.op) if (f_rec or r_rec) else None
    position = loc.recompute if loc.recompute is not None else loc.forward
    if loc.what is Divergence.UNLOCATED:
        where = f"differs from its forward, not located in the op stream ({loc.detail})"
    elif position is None:
        where = f"differs from its forward ({loc.what}): {loc.detail}"
    else:
        where = f"differs from its forward at op #{position} ({loc.what}): {loc.detail}"
    if loc.interval is not None:
        where += (f" (values sampled: one op in {replay.stream.every}, each side's last and the "
                  f"ops next to its sampled saved tensors are fingerprinted; the first "
                  f"difference is at one of ops #{loc.interval[0]} to #{loc.interval[1]})")
    sites = ""
    if replay.light and recompute_site:  # ``none``: the write's own site, no forward op
        sites = f" Recompute op at {describe_site(recompute_site)}."
    elif loc.what is not Divergence.UNLOCATED:
        sites = (f" Forward op at {_site_or(forward_site, 'the forward')}; recompute op at "
                 f"{_site_or(recompute_site, 'the recompute')}.")
    message = f"recompute of checkpointed region {region.name()} {where}.{sites}"
    if finding.verdict is not Verdict.SIDE_EFFECT:
        message += f" Backward uses it: {finding.item}: {finding.detail}, {_WHY}."
    else:
        message += (" The sanitizer gave the tensor its contents from before the recompute "
                    "back. Keep the update out of the checkpointed region, capture that state "
                    "per region (fixes.recompute.state_preserving_context_fn / "
                    "state_preserving), or, if the write is intended, declare it "
                    "(fixes.sanitize.recompute_may_differ / scratch_tensors).")
    raise RecomputeMismatchError(
        message, region=region.name(), verdict=finding.verdict, item=finding.item,
        what=loc.what, position=position, op=op, forward_site=forward_site,
        recompute_site=recompute_site)


def _site_or(site: tuple, side: str) -> str:
    return describe_site(site) if site else f"(none: {side} did not run this op)"

