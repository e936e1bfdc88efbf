# GPU batch L (2 GPUs): the MoE GPT with its experts split over two NCCL ranks, every strategy, size and dtype
. ci/gpu_env.sh || exit 1
export NCCL_NVLS_ENABLE=0
timeout 330 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -k ep2 -p no:cacheprovider -p no:xdist -rA \
  --benchmark-json="$OUT/bench-megatron-scale-ep2-gpu.json" > "$OUT/bench-megatron-scale-ep2-gpu.log" 2>&1; echo "bench rc=$?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/bench-megatron-scale-ep2-gpu.log" | tail -15
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m benchmarks.megatron_scale --device cuda --models gpt-mtp \
   --strategies none,verl-0.8.0,ours --dtypes fp32,bf16 --sizes 1024x2048 --steps 100 --out "$OUT/steptime-1024-100steps-gpt-mtp.json" \
   > "$OUT/steptime-1024-100steps-gpt-mtp.log" 2>&1; echo "steptime rc=$?" >> "$OUT/steptime-1024-100steps-gpt-mtp.log"
tail -12 "$OUT/steptime-1024-100steps-gpt-mtp.log"
