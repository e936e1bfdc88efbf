# Call E on one H200 (2026-12-01), after frame kinds were cached by id(code) (36f1b80): the
# sanitizer's host cost per op (flat and inside 4 nested modules) and its cost on the real
# megatron models, alone on the GPU. Carry [".whl"]; fits the session's last ~280 s of device time.
. ci/gpu_env.sh || exit 1
for m in 0 4; do
  timeout 40 python3 -m benchmarks.sanitizer_per_op --device cuda --modules $m \
    --json "$OUT/sanitizer-per-op-cuda-m$m.json" > "$OUT/sanitizer-per-op-cuda-m$m.log" 2>&1
  echo "per-op modules=$m rc=$?"
done
timeout 125 python3 -m pytest benchmarks/test_bench_sanitize.py -m gpu -k megatron -p no:cacheprovider \
  -p no:xdist -rA -s --benchmark-json="$OUT/bench-gpu-sanitize-megatron.json" \
  > "$OUT/bench-gpu-sanitize-megatron.log" 2>&1; echo "sanitize megatron rc=$?"
tail -n 5 "$OUT"/*.log
