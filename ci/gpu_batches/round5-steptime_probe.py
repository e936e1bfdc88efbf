"""Where does a reclaim's step time go at H=1024 S=2048 GPT+MTP bf16 (launch-bound 26 ms steps)?

One process per strategy (verl: one release per process), interleaved with none as megatron_scale
does. Per step: wall time, GPU time (CUDA events), and the CPU time spent inside
CheckpointFunction.backward: outer (whatever is installed) and inner (megatron's own backward;
ours wraps it, verl replaces it). Then a torch.profiler table for 3 steps of each.
usage (repository root, after . ci/gpu_env.sh): python ci/gpu_batches/round5-steptime_probe.py STRATEGY MODEL DTYPE HIDDEN SEQ STEPS
"""
import gc
import statistics
import sys
import time

import torch

from benchmarks import megatron_scale as ms
from repro.shared_view_reclaim import install_reclaim, setup_megatron

strategy, model, dtype, hidden, seq, steps = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
setup_megatron("cuda")
from megatron.core.tensor_parallel.random import CheckpointFunction as CF  # noqa: E402

acc = {"inner": 0.0, "outer": 0.0, "calls": 0}
orig = CF.__dict__["backward"].__func__


def inner(ctx, *g):
    t = time.perf_counter()
    try:
        return orig(ctx, *g)
    finally:
        acc["inner"] += time.perf_counter() - t


CF.backward = staticmethod(inner)
_saved = []


def switch(name):
    if _saved:
        CF.backward = _saved.pop()
    install_reclaim(ms._INSTALL[name], CF)
    cur = CF.__dict__["backward"]
    fn = cur.__func__

    def outer(ctx, *g):
        t = time.perf_counter()
        try:
            return fn(ctx, *g)
        finally:
            acc["outer"] += time.perf_counter() - t
            acc["calls"] += 1

    _saved.append(cur)
    CF.backward = staticmethod(outer)


gpt = ms._build(model, "allgather", hidden, seq, dtype, "cuda")
ids = torch.randint(0, 32000, (1, seq), device="cuda")
pos = torch.arange(seq, device="cuda").unsqueeze(0)
mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda").tril().logical_not()
labels = torch.randint(0, 32000, (1, seq), device="cuda")


def step():
    gpt.zero_grad(set_to_none=True)
    gpt(ids, pos, mask, labels=labels).float().sum().backward()


own = [strategy, "none"] if strategy != "none" else ["none"]
for name in own:
    switch(name)
    step()
    step()
torch.cuda.synchronize()
gc.collect()
gc.disable()
rec = {n: {"wall": [], "gpu": [], "outer": [], "inner": [], "fwd": []} for n in own}
for i in range(steps):
    for name in own if i % 2 == 0 else own[::-1]:
        switch(name)
        torch.cuda.synchronize()
        acc.update(inner=0.0, outer=0.0, calls=0)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        e0.record()
        gpt.zero_grad(set_to_none=True)
        loss = gpt(ids, pos, mask, labels=labels).float().sum()
        tf = time.perf_counter()
        loss.backward()
        e1.record()
        tb = time.perf_counter()
        torch.cuda.synchronize()
        r = rec[name]
        r["wall"].append((time.perf_counter() - t) * 1e3)
        r["fwd"].append((tf - t) * 1e3)
        r["gpu"].append(e0.elapsed_time(e1))
        r["outer"].append(acc["outer"] * 1e3)
        r["inner"].append(acc["inner"] * 1e3)
        r.setdefault("cpu_issue", []).append((tb - t) * 1e3)
gc.enable()
print(f"== {model} {dtype} H={hidden} S={seq} {strategy} vs none, {steps} interleaved steps, "
      f"{acc['calls']} checkpoint backwards per step; medians in ms")
for name in own:
    r = rec[name]
    print(f"{name:12s} " + " ".join(f"{k}={statistics.median(v):8.3f}" for k, v in r.items()))
if len(own) > 1:
    a, b = rec[strategy], rec["none"]
    print("step ratio (median of pairs):", round(statistics.median(x / y for x, y in zip(a["wall"], b["wall"], strict=True)), 4))
    print("gpu ratio (median of pairs):", round(statistics.median(x / y for x, y in zip(a["gpu"], b["gpu"], strict=True)), 4))
    print("outer-inner (reclaim CPU in backward) median ms:",
          round(statistics.median(o - i for o, i in zip(a["outer"], a["inner"], strict=True)), 3))
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for name in own:
    switch(name)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"---- profiler: {name}, 3 steps, top by self CPU")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
