# GPU batch for what issues 20, 22 and 24 still need on one H200 (written 2026-12-01, when this
# session's device time was spent; not run yet). ~9 min: run as one device call, carry [".whl"].
. ci/gpu_env.sh || exit 1
# Issue 20: verl 0.9.1's Megatron engine order with the plugin (both install orders), memory
# freed compared with the reclaim bench baseline's.
timeout 150 python3 -m pytest -m gpu tests/test_verl_plugin.py -p no:cacheprovider -p no:xdist -rA -s \
  > "$OUT/pytest-gpu-verl-plugin.log" 2>&1; echo "verl plugin rc=$?"
# Issue 24: sanitizer cost, all / sampled / none, plain transformer and the real megatron models,
# alone on the GPU; and the atomics spread next to its tolerance.
timeout 200 python3 -m pytest benchmarks/test_bench_sanitize.py tests/test_sanitize_recompute_gpu.py -m gpu \
  -p no:cacheprovider -p no:xdist -s --benchmark-json="$OUT/bench-gpu-sanitize.json" \
  > "$OUT/bench-gpu-sanitize.log" 2>&1; echo "sanitize rc=$?"
# Issue 22: the GPU main job with the default -j and with -j 1 (outcomes must be equal), and the
# gpu suite on 8 xdist workers.
( time timeout 170 python3 -m repro --device cuda --json "$OUT/repro-cuda-j.json" ) \
  > "$OUT/repro-cuda-j.log" 2>&1; echo "repro -j rc=$?"
( time timeout 200 python3 -m pytest tests -m gpu -n 8 -p no:cacheprovider -q ) \
  > "$OUT/pytest-gpu-n8.log" 2>&1; echo "gpu suite rc=$?"
tail -3 "$OUT"/*.log
