# Call A for issues 20, 22 and 24 on one H200 (2026-12-01): run as one device call, carry [".whl"].
. ci/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/environment.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" >> "$OUT/environment.txt" 2>&1
nproc >> "$OUT/environment.txt"
# Issue 20: verl 0.9.1's Megatron engine order with and without the plugin (both install orders).
timeout 90 python3 -m pytest -m gpu tests/test_verl_plugin.py -p no:cacheprovider -p no:xdist -rA -s \
  > "$OUT/pytest-gpu-verl-plugin.log" 2>&1; echo "verl plugin rc=$?"
# Issue 24: sanitizer cost, all / sampled / none, alone on the GPU; the atomics spread.
timeout 220 python3 -m pytest benchmarks/test_bench_sanitize.py tests/test_sanitize_recompute_gpu.py -m gpu \
  -p no:cacheprovider -p no:xdist -rA -s --benchmark-json="$OUT/bench-gpu-sanitize.json" \
  > "$OUT/bench-gpu-sanitize.log" 2>&1; echo "sanitize rc=$?"
# Issue 22: where a CUDA child's time goes (start-up phases; four repros' paths one at a time).
timeout 90 python3 -m benchmarks.child_phases --device cuda --probes 3 --only shared-view-reclaim \
  --only mesh-recompute --only mesh-recompute-tp2-block --only mtp-shape --json "$OUT/child-phases-cuda.json" \
  > "$OUT/child-phases-cuda.log" 2>&1; echo "phases rc=$?"
# Issue 22: the GPU main job with the default -j.
( time timeout 170 python3 -m repro --device cuda --json "$OUT/repro-cuda-j.json" ) \
  > "$OUT/repro-cuda-j.log" 2>&1; echo "repro -j rc=$?"
tail -n 3 "$OUT"/*.log
