"""How the benchmarks measure one training step.

- Bytes on CPU: ``torch.distributed._tools.mem_tracker.MemTracker``, a dispatch mode that
  counts the bytes of every live storage it has seen (it also patches
  ``UntypedStorage.resize_``, so a reclaim's ``resize_(0)`` shows up). Deterministic: the
  same program gives the same figures to the byte, run after run.
- Bytes on GPU: the CUDA caching allocator's ``max_memory_allocated`` after
  ``reset_peak_memory_stats``. Only where ``torch.cuda.is_available()``: the CPU build of
  torch returns 0 from these silently, which a gate would read as a win.
- FLOPs: ``torch.utils.flop_counter.FlopCounterMode``. It counts matmul-like ops (mm, bmm,
  addmm, convolution, the CUDA SDPA kernels); the CPU SDPA kernel has no formula there, so
  CPU figures leave attention out. Recompute FLOPs are the backward pass's FLOPs minus those
  of the same backward without activation checkpointing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

DEVICE_TYPES = ("cpu", "cuda")


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device of a measurable type; ValueError naming the allowed ones."""
    device = torch.device(device)
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"device type {device.type!r} is not measurable; allowed: {DEVICE_TYPES}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            # Never fall through to torch.cuda.max_memory_allocated(): it returns 0 here.
            raise RuntimeError("CUDA peak-memory stats need CUDA; torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_kind(device: torch.device | str) -> str:
    """The name a baseline is filed under: ``cpu``, or ``gpu-`` plus the GPU's model
    (``NVIDIA H200`` -> ``gpu-h200``). Figures are only comparable within one kind."""
    device = check_device(device)
    if device.type == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)
    return "gpu-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown")


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """One training step's bytes: the high-water mark, what forward leaves live for backward,
    and what is still live when backward returns (parameters and gradients included)."""

    peak_bytes: int
    after_forward_bytes: int
    end_of_backward_bytes: int

    def as_extra_info(self) -> dict[str, int]:
        return {
            "peak_bytes": self.peak_bytes,
            "after_forward_bytes": self.after_forward_bytes,
            "end_of_backward_bytes": self.end_of_backward_bytes,
        }


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def measure_memory(
    forward: Callable[[], torch.Tensor],
    *,
    device: torch.device | str,
    track: Iterable[torch.nn.Module | torch.Tensor] = (),
    backward: Callable[[torch.Tensor], object] = _default_backward,
) -> MemoryFigures:
    """Run ``loss = forward()`` then ``backward(loss)`` once and return the bytes on ``device``.

    On CPU only storages created inside the step plus those of ``track`` (modules: their
    parameters, buffers and gradients; tensors) are counted; on CUDA everything the caching
    allocator holds for live tensors on that device is. Run a warm-up step first: lazily
    built state (caches, the autograd engine's own) would otherwise land in the figures.
    No other dispatch mode may be active: FlopCounterMode, for one, keeps tensors alive
    through its module tracker, so FLOPs are counted in a step of their own (``count_flops``).
    """
    device = check_device(device)
    if device.type == "cpu":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        track = list(track)
        if track:
            tracker.track_external(*track)

        def live(kind: str) -> int:
            return int(tracker.get_tracker_snapshot(kind).get(device, {}).get("Total", 0))

        with tracker:
            loss = forward()
            after_forward = live("current")
            backward(loss)
            end = live("current")
        return MemoryFigures(live("peak"), after_forward, end)

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = forward()
    torch.cuda.synchronize(device)
    after_forward = int(torch.cuda.memory_allocated(device))
    backward(loss)
    torch.cuda.synchronize(device)
    return MemoryFigures(
        int(torch.cuda.max_memory_allocated(device)),
        after_forward,
        int(torch.cuda.memory_allocated(device)),
    )


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the ops ``fn`` dispatches (FlopCounterMode's formulas)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def backward_flops(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], object] = _default_backward,
) -> int:
    """FLOPs of one step's backward pass alone (checkpoint recompute included)."""
    loss = forward()
    return count_flops(lambda: backward(loss))
