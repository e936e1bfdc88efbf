"""The detect tier's print of one region side on a real megatron-core MoE layer, fused against
per tensor.

The side: the tensors one ``TransformerLayer`` of ``benchmarks.megatron_scale``'s MoE GPT saves
for backward (its forward run without recompute under a saved-tensors hook: what a
non-reentrant checkpoint of the layer hands the sanitizer). Printed by the fused path
(``fixes.sanitize._fused.prints``: one Triton kernel on CUDA) and tensor by tensor
(``_fingerprint.fingerprint``, the torch ops the detect tier ran before), exact and exact plus
tolerant (the default on CUDA). Per path and kind: the median over ``--repeats`` of the host
time until the call returns (``*_host_ms``) and until the device is done (``*_ms``), and the
kernels one side launches (torch.profiler; CUDA only). On CUDA the fused prints are also
checked against the CPU path's on the same tensors (``equal_to_cpu``). Prints ``FUSED-PRINT
{json}`` (one entry per dtype) and writes it to ``--json``.

``--sweep`` (CUDA) also times the fused kernel under each launch shape of ``SWEEP`` (elements
per program and per loop step, warps per program): how the shipped one was chosen.

    python -m benchmarks.fused_print --device cuda --size 1024x2048 --dtypes fp32,bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def side_of_a_layer(hidden: int, seq: int, dtype: str, device: str) -> list:
    """The tensors the second transformer layer of the MoE GPT saves in one forward."""
    import torch

    from benchmarks.megatron_scale import _build
    from repro.harness.megatron_world import setup_megatron

    setup_megatron(device)
    if device == "cpu":
        from fixes.testing.megatron_cpu import install_megatron_cpu_moe_shim

        install_megatron_cpu_moe_shim()
    gpt = _build("moe", "allgather", hidden, seq, dtype, device)
    for m in gpt.modules():  # no recompute: the layer's forward saves for backward
        if getattr(m, "config", None) is not None:
            m.config.recompute_granularity = None
    layer = [m for m in gpt.modules() if type(m).__name__ == "TransformerLayer"][1]
    saved: list = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x,
                                                     lambda x: x)
    layer.register_forward_pre_hook(lambda *a: hooks.__enter__())
    layer.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (1, seq), generator=g).to(device)
    pos = torch.arange(seq, device=device).unsqueeze(0)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).tril().logical_not()
    gpt(ids, pos, mask)
    return saved


def _time(fn, sync, repeats: int) -> tuple[float, float]:
    host, total = [], []
    fn()  # compiled, weights grown
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        sync()
        total.append(time.perf_counter() - t)
    return statistics.median(host) * 1e3, statistics.median(total) * 1e3


def _kernels(fn, device: str) -> int | None:
    import torch

    if device != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def measure(hidden: int, seq: int, dtype: str, device: str, repeats: int,
            sweep: bool = False, stages: bool = False) -> dict:
    import torch

    from fixes.sanitize import _detect, _fused
    from fixes.sanitize import _fingerprint as fp

    tensors = side_of_a_layer(hidden, seq, dtype, device)
    cuda = any(t.device.type == "cuda" for t in tensors)
    side = [t if _detect._valued(t, cuda) else None for t in tensors]
    kept = [t for t in side if t is not None]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    paths = {
        "fused": lambda: _fused.prints(side),
        "fused_tolerant": lambda: _fused.prints(side, tolerant=True),
        "per_tensor": lambda: [fp.fingerprint([t]) for t in kept],
        "per_tensor_tolerant": lambda: ([fp.fingerprint([t]) for t in kept],
                                        [fp.fingerprint([t], tolerant=True) for t in kept]),
    }
    result = {"hidden": hidden, "seq": seq, "dtype": dtype, "device": device,
              "tensors": len(side), "printed": len(kept),
              "elements": sum(t.numel() for t in kept),
              "bytes": sum(t.numel() * t.element_size() for t in kept),
              "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in kept}),
              "contiguous": sum(t.is_contiguous() for t in kept), "repeats": repeats}
    for name, fn in paths.items():
        result[f"{name}_host_ms"], result[f"{name}_ms"] = _time(fn, sync, repeats)
        result[f"{name}_kernels"] = _kernels(fn, device)
    result["kernel_failed"] = list(_fused.FAILED)
    if sweep:
        result["sweep"] = launch_sweep(kept, sync, repeats)
    if stages:
        result["host_stages"] = host_stages(kept, repeats)
    if device == "cuda":
        got, _ = _fused.prints(side)
        want, _ = _fused.prints([None if t is None else t.cpu() for t in side])
        key = lambda p: None if p is None else [int(v) for v in p.exact]  # noqa: E731
        result["equal_to_cpu"] = [key(p) for p in got] == [key(p) for p in want]
    return result


# (elements per program, elements per loop step, warps per program) tried by --sweep
SWEEP = [(chunk, block, warps) for chunk in (1 << 13, 1 << 15, 1 << 17)
         for block, warps in ((256, 2), (256, 4), (512, 4), (512, 8), (1024, 4), (1024, 8),
                              (2048, 8), (2048, 16))]


def launch_sweep(kept: list, sync, repeats: int) -> list[dict]:
    """The fused kernel on ``kept`` (tolerant: CUDA's default) under each launch shape of
    ``SWEEP``: its median time until the device is done, and whether its exact prints equal
    the shipped shape's (integer sums: any blocking gives the same)."""
    from fixes.sanitize import _fused

    real = [_fused._real(t) for t in kept]
    summed = [r.dtype in _fused._KIND for r in real]
    device = real[0].device

    def exact(shape):
        return _fused._launch(real, summed, device, *shape)[:, 0].tolist()

    want = exact((_fused.CHUNK, _fused.BLOCK, _fused.NUM_WARPS))
    out = []
    for shape in SWEEP:
        _, ms = _time(lambda shape=shape: _fused._launch(real, summed, device, *shape), sync,
                      repeats)
        out.append({"chunk": shape[0], "block": shape[1], "num_warps": shape[2], "ms": ms,
                    "equal": exact(shape) == want})
    return out


def host_stages(kept: list, repeats: int, sizes=(1, 4, 32)) -> list[dict]:
    """Per side of the first ``k`` tensors of ``kept`` (``k`` in ``sizes``): the median host
    microseconds a call of each stage of ``_fused.prints`` takes (the table built, pinned,
    copied to the device, the kernel launched; the whole side as the detect tier keeps it,
    ``side_prints``; and with a ``Print`` made per tensor, ``prints``), and of the
    alternatives to the pinned copy (a preallocated pinned buffer filled through numpy and
    copied) and of a whole side's comparison (one op per column). Each figure:
    the median over ``repeats`` batches of 20 calls, the device synchronised between
    batches."""
    import torch

    from fixes.sanitize import _fused

    cuda = kept[0].device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kernel = _fused._triton() if cuda else _fused._interpreted()
    staging = torch.zeros(1 << 16, dtype=torch.int64, pin_memory=cuda)
    out = []
    for k in sizes:
        stages = _side_stages(kept[:k], cuda, kernel, staging)
        row = {"tensors": k}
        for name, fn in stages.items():
            if fn is None:
                continue
            fn()
            batches = []
            for _ in range(repeats):
                sync()
                t = time.perf_counter()
                for _ in range(20):
                    fn()
                batches.append((time.perf_counter() - t) / 20)
            row[f"{name}_us"] = statistics.median(batches) * 1e6
        sync()
        out.append(row)
    return out


def _side_stages(side: list, cuda: bool, kernel, staging) -> dict:
    """``host_stages``'s stages of one side: name -> a call (None: not on this device)."""
    import torch

    from fixes.sanitize import _fused

    device = side[0].device
    real = [_fused._real(t) for t in side]
    summed = [r.dtype in _fused._KIND for r in real]
    host, programs, _ = _fused._table(real, summed, _fused.CHUNK)
    rows_list = host.tolist()
    pinned = host.pin_memory() if cuda else host
    buf = pinned.to(device, non_blocking=True)
    n = len(real)
    out_at = n * _fused.NCOL + programs
    res = buf[out_at:].view(n, _fused.NOUT)
    other = res.clone()
    warps = {"num_warps": _fused.NUM_WARPS} if cuda else {}

    def launch():
        kernel[(programs,)](buf, n * _fused.NCOL, out_at, CHUNK=_fused.CHUNK,
                            BLOCK=_fused.BLOCK, **warps)

    def staged():
        view = staging[:len(rows_list)]
        view.numpy()[:] = rows_list
        torch.empty(len(rows_list), dtype=torch.int64, device=device).copy_(
            view, non_blocking=True)

    return {
        "table": lambda: _fused._table(real, summed, _fused.CHUNK),
        "pin": (lambda: host.pin_memory()) if cuda else None,
        "h2d": lambda: pinned.to(device, non_blocking=True),
        "staged_h2d": staged if cuda else None,
        "launch": launch,
        "compare_whole": lambda: (res[:, 0] != other[:, 0]).any(),
        "side": lambda: _fused.side_prints(side, tolerant=True),
        "prints": lambda: _fused.prints(side, tolerant=True),
    }


def by_dtype(stdout: str, dtypes: tuple[str, ...]) -> dict[str, dict]:
    """A child's ``FUSED-PRINT`` line read back: one result per dtype, in the order asked
    (ValueError without the line, or with another count)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("FUSED-PRINT ")]
    if not lines:
        raise ValueError("no FUSED-PRINT line in the child's output")
    return dict(zip(dtypes, json.loads(lines[-1].split(" ", 1)[1]), strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_print")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--size", default="1024x2048", help="HIDDENxSEQ")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--sweep", action="store_true",
                   help="also time the fused kernel under each launch shape of SWEEP (CUDA)")
    p.add_argument("--host-stages", action="store_true",
                   help="also time the host's stages of one side's print (host_stages)")
    args = p.parse_args(argv)
    if args.sweep and args.device != "cuda":
        p.error("--sweep times the Triton kernel's launch shapes: CUDA only")
    hidden, seq = (int(v) for v in args.size.split("x"))
    results = [measure(hidden, seq, d, args.device, args.repeats, args.sweep,
                       args.host_stages) for d in args.dtypes.split(",")]
    for r in results:
        for row in r.get("sweep", []):
            print(f"SWEEP {r['dtype']} chunk {row['chunk']:6d} block {row['block']:4d} warps "
                  f"{row['num_warps']:2d}: {row['ms']:7.3f} ms  equal {row['equal']}",
                  flush=True)
        for row in r.get("host_stages", []):
            print(f"HOST-STAGES {r['dtype']} " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                flush=True)
    print("FUSED-PRINT " + json.dumps(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
