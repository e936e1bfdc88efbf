# Issue 34 on one H200, call B (not run yet): the recompute sanitizer on the real megatron models,
# alone on the GPU: no false positive and the step-time ratio of every values mode, MoE GPT with
# the aux loss off and on (full and MoE-layer recompute) and GPT+MTP, fp32 and bf16 (8 cells).
# Carry [".whl"]. About 300 s.
. ci/gpu_env.sh || exit 1
timeout 330 python3 -m pytest benchmarks/test_bench_sanitize.py -m gpu -k megatron \
  -p no:cacheprovider -p no:xdist -rA -s --benchmark-json="$OUT/bench-gpu-sanitize-megatron.json" \
  > "$OUT/bench-gpu-sanitize-megatron.log" 2>&1; echo "sanitize megatron rc=$?"
tail -n 5 "$OUT"/*.log
