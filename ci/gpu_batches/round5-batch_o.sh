# GPU batch O (2 GPUs), after the no-leak fast path: the EP=2 bench cells, then the whole gpu test suite
. ci/gpu_env.sh || exit 1
export NCCL_NVLS_ENABLE=0
timeout 220 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -k ep2 -p no:cacheprovider -p no:xdist -rA \
  --benchmark-json="$OUT/bench-megatron-scale-ep2-gpu.json" > "$OUT/bench-megatron-scale-ep2-gpu.log" 2>&1; echo "bench rc=$?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/bench-megatron-scale-ep2-gpu.log" | tail -15
timeout 330 python3 -m pytest tests -m gpu -n 14 -p no:cacheprovider -rA --durations=20 > "$OUT/pytest-gpu-2gpu.log" 2>&1; echo "pytest gpu rc=$?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/pytest-gpu-2gpu.log" | tail -20
