# Issue 34 on one H200, call A (not run yet): the recompute sanitizer's host cost per op, where a
# sanitized step's host time goes on the real MoE GPT (cProfile per values mode; aux loss off
# and on, full and MoE-layer recompute) and its CUDA test (atomics within the tolerance, a real
# difference caught). Call B: h200-issue-34-b.sh. Carry [".whl"] (megatron-core for the image's
# Python). About 480 s.
. ci/gpu_env.sh || exit 1
timeout 60 python3 -m benchmarks.sanitizer_per_op --device cuda \
  --json "$OUT/sanitizer-per-op-cuda.json" > "$OUT/sanitizer-per-op-cuda.log" 2>&1
echo "per-op rc=$?"
for args in "--aux-loss 0 --recompute full" "--aux-loss 0.01 --recompute full" \
            "--aux-loss 0.01 --recompute moe-layer"; do
  name=$(echo "$args" | tr -d ' -' | tr '.' 'p')
  timeout 100 python3 -m benchmarks._sanitize_megatron --model moe --device cuda --size 1024x2048 \
    --steps 4 $args --profile "$OUT/profile-moe-$name.txt" > "$OUT/sanitize-moe-$name.log" 2>&1
  echo "moe $args rc=$?"
done
timeout 120 python3 -m pytest tests/test_sanitize_recompute_gpu.py -m gpu -p no:cacheprovider \
  -p no:xdist -rA -s > "$OUT/test-sanitize-recompute-gpu.log" 2>&1; echo "gpu test rc=$?"
tail -n 5 "$OUT"/*.log
