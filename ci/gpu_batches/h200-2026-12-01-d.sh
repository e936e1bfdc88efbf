# Call D on one H200 (2026-12-01): the recompute sanitizer's host cost per op next to a
# pass-through dispatch mode's (issue 24), and where a Megatron-LM dev repro child's time goes
# (issue 22: the two mtp-shape-megatron-dev rows are the main job's longest). Carry
# [".whl", ".megatron-lm"].
. ci/gpu_env.sh || exit 1
timeout 90 python3 -m benchmarks.sanitizer_per_op --device cuda --json "$OUT/sanitizer-per-op-cuda.json" \
  > "$OUT/sanitizer-per-op-cuda.log" 2>&1; echo "per-op rc=$?"
python3 -m benchmarks.sanitizer_per_op --device cpu --json "$OUT/sanitizer-per-op-cpu.json" \
  > "$OUT/sanitizer-per-op-cpu.log" 2>&1; echo "per-op cpu rc=$?"
timeout 150 python3 -m benchmarks.child_phases --device cuda --probes 1 --only mtp-shape-megatron-dev \
  --json "$OUT/child-phases-megatron-dev.json" > "$OUT/child-phases-megatron-dev.log" 2>&1
echo "phases rc=$?"
tail -n 8 "$OUT"/*.log
