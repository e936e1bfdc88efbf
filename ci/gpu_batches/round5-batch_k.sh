# GPU batch K (2 GPUs): the megatron-scale bench (world size 1) split over the two GPUs; then, on GPU 1,
# step time at H=1024 S=2048 with 100 interleaved steps (every model, both dtypes)
. ci/gpu_env.sh || exit 1
export NCCL_NVLS_ENABLE=0
(CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -p no:cacheprovider -p no:xdist -rA \
   -k "not gpt-mtp and not kept-probs and not ep2" --benchmark-json="$OUT/bench-megatron-scale-gpu-moe.json" \
   > "$OUT/bench-megatron-scale-gpu-moe.log" 2>&1; echo "bench moe rc=$?" >> "$OUT/bench-megatron-scale-gpu-moe.log"
 CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m benchmarks.megatron_scale --device cuda --models moe,moe-kept-probs,gpt-mtp \
   --strategies none,verl-0.8.0,ours --dtypes fp32,bf16 --sizes 1024x2048 --steps 100 --out "$OUT/steptime-1024-100steps.json" \
   > "$OUT/steptime-1024-100steps.log" 2>&1; echo "steptime rc=$?" >> "$OUT/steptime-1024-100steps.log") &
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -p no:cacheprovider -p no:xdist -rA \
  -k "gpt-mtp or kept-probs" --benchmark-json="$OUT/bench-megatron-scale-gpu-mtp-kept.json" \
  > "$OUT/bench-megatron-scale-gpu-mtp-kept.log" 2>&1; echo "bench mtp/kept rc=$?"
wait
for f in "$OUT"/bench-megatron-scale-gpu-*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$f" | tail -12; done
tail -30 "$OUT/steptime-1024-100steps.log"
