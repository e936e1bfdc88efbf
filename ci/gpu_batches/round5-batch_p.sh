# GPU batch P (2 GPUs): the EP=2 step-time cells again, now with 60 interleaved steps
. ci/gpu_env.sh || exit 1
export NCCL_NVLS_ENABLE=0
timeout 150 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -k "ep2 and step_time" -p no:cacheprovider -p no:xdist -rA \
  > "$OUT/bench-megatron-scale-ep2-steptime60.log" 2>&1; echo "bench rc=$?"
grep -E "^(FAILED|ERROR|SKIPPED|PASSED)|passed|failed|assert" "$OUT/bench-megatron-scale-ep2-steptime60.log" | tail -15
timeout 80 python3 -m benchmarks.megatron_scale --device cuda --models moe --ep 2 --strategies ours --dtypes bf16,fp32 --sizes 2048x4096 \
  --steps 60 --out "$OUT/steptime-ep2-2048-60steps.json" > "$OUT/steptime-ep2-2048-60steps.log" 2>&1; echo "cli rc=$?"
tail -4 "$OUT/steptime-ep2-2048-60steps.log"
