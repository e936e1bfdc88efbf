# GPU batch N (2 GPUs), after the no-leak fast path: the megatron-scale bench (world size 1) split over
# the two GPUs; on GPU 1 then: where step time goes (probe), and 100-step step time at H=1024 bf16
. ci/gpu_env.sh || exit 1
export NCCL_NVLS_ENABLE=0
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -p no:cacheprovider -p no:xdist -rA \
   -k "not gpt-mtp and not kept-probs and not ep2" --benchmark-json="$OUT/bench-megatron-scale-gpu-moe.json" \
   > "$OUT/bench-megatron-scale-gpu-moe.log" 2>&1; echo "bench moe rc=$?" >> "$OUT/bench-megatron-scale-gpu-moe.log"
 for m in gpt-mtp moe-kept-probs; do
   CUDA_VISIBLE_DEVICES=1 timeout 80 python3 ci/gpu_batches/round5-steptime_probe.py ours $m bf16 1024 2048 40 > "$OUT/probe-ours-$m.log" 2>&1; echo "rc=$?" >> "$OUT/probe-ours-$m.log"
 done
 CUDA_VISIBLE_DEVICES=1 timeout 110 python3 -m benchmarks.megatron_scale --device cuda --models gpt-mtp,moe-kept-probs \
   --strategies none,ours --dtypes bf16 --sizes 1024x2048 --steps 100 --out "$OUT/steptime-1024-bf16-100steps.json" \
   > "$OUT/steptime-1024-bf16-100steps.log" 2>&1; echo "steptime rc=$?" >> "$OUT/steptime-1024-bf16-100steps.log") &
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m pytest benchmarks/test_bench_megatron_scale.py -m gpu -p no:cacheprovider -p no:xdist -rA \
  -k "gpt-mtp or kept-probs" --benchmark-json="$OUT/bench-megatron-scale-gpu-mtp-kept.json" \
  > "$OUT/bench-megatron-scale-gpu-mtp-kept.log" 2>&1; echo "bench mtp/kept rc=$?"
wait
for f in "$OUT"/bench-megatron-scale-gpu-*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$f" | tail -12; done
for f in "$OUT"/probe-ours-*.log; do grep -A4 "^==" "$f"; tail -1 "$f"; done
tail -6 "$OUT/steptime-1024-bf16-100steps.log"
