"""What ``benchmarks.megatron_scale`` measures a cell with: the CUDA caching allocator's
statistics (with ``--trace``, the allocation sites live at the peak from its memory history),
or MemTracker's exact bytes on CPU. One interface: ``build()`` / ``measured()`` contexts,
``current()``, ``peak()``, ``requested(kind)``, ``sync()``, ``sites()``."""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["CpuMeter", "CudaMeter", "peak_sites"]


def _site(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python (where a model or patch allocated)."""
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name and "megatron_scale" not in name:
            return f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


_MARK_BYTES = 7919 * 512  # an allocation of this size marks where the measured step begins


def peak_sites(snapshot: dict, top: int = 12) -> list[tuple[str, int]]:
    """Replay a memory-history trace recorded from before the model was built; the ``top``
    allocation sites by bytes live at the highest point after the marker allocation (the
    measured step), blocks from the build and the warm-up step included."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_peak: dict[int, tuple[int, str]] = {}
    measuring = False
    for trace in snapshot.get("device_traces", []):
        for ev in trace:
            if ev["action"] == "alloc":
                if ev["size"] == _MARK_BYTES:
                    measuring = True
                live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
                total += ev["size"]
                if measuring and total > best:
                    best, at_peak = total, dict(live)
            elif ev["action"] == "free_requested" and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
    sites: dict[str, int] = {}
    for size, site in at_peak.values():
        sites[site] = sites.get(site, 0) + size
    return sorted(sites.items(), key=lambda kv: -kv[1])[:top]


class CudaMeter:
    """The caching allocator's statistics (bytes of live tensors, rounded to its blocks)."""

    def __init__(self, trace: bool):
        import torch

        self.torch, self.trace = torch, trace
        if trace:  # from before the build: every live block at the peak gets its site
            torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")

    def current(self) -> int:
        return self.torch.cuda.memory_allocated()

    def requested(self, kind: str) -> int:
        return self.torch.cuda.memory_stats().get(f"requested_bytes.all.{kind}", 0)

    @contextmanager
    def build(self):
        yield

    @contextmanager
    def measured(self):
        torch = self.torch
        torch.cuda.synchronize()
        if self.trace:  # the marker: the replay's window opens here
            torch.empty(_MARK_BYTES, dtype=torch.uint8, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated()

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def sites(self) -> list | None:
        if not self.trace:
            return None
        sites = peak_sites(self.torch.cuda.memory._snapshot())
        self.torch.cuda.memory._record_memory_history(enabled=None)
        return sites


class CpuMeter:
    """MemTracker: exact bytes of every storage created since the build (it patches
    ``UntypedStorage.resize_`` while active, so a reclaim's ``resize_(0)`` counts). Entering it
    again restarts its peak at the current total; what it tracked stays tracked."""

    def __init__(self, trace: bool):
        from torch.distributed._tools.mem_tracker import MemTracker

        if trace:
            raise SystemExit("error: --trace needs --device cuda (the CUDA allocator's history)")
        self.tracker = MemTracker()

    def _total(self, kind: str) -> int:
        import torch

        snap = self.tracker.get_tracker_snapshot(kind)
        return int(snap.get(torch.device("cpu"), {}).get("Total", 0))

    def current(self) -> int:
        return self._total("current")

    def requested(self, kind: str) -> int:
        return 0  # no allocator rounding on CPU: requested_peak_bytes stays 0

    def build(self):
        return self.tracker

    @contextmanager
    def measured(self):
        self.tracker.reset_mod_stats()  # per-module stats are per iteration; totals are kept
        with self.tracker:
            yield

    def peak(self) -> int:
        return self._total("peak")

    def sync(self) -> None:
        pass

    def sites(self) -> None:
        return None
