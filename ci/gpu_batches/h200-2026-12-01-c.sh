# Call C for issue 22 on one H200 (2026-12-01), after the fork server learned to leave a preload
# that starts a thread (megatron.core's CUDA driver thread) to its children: the start-up phases
# forked and spawned, the GPU main job with the default -j and with -j 1 (outcomes must be
# equal), and the gpu suite on 8 workers. One device call, carry [".whl", ".megatron-lm"].
. ci/gpu_env.sh || exit 1
timeout 60 python3 -m benchmarks.child_phases --device cuda --probes 1 --only shared-view-reclaim \
  --only mtp-shape --json "$OUT/child-phases-cuda.json" > "$OUT/child-phases-cuda.log" 2>&1
echo "phases rc=$?"
( time timeout 120 python3 -m repro --device cuda --json "$OUT/repro-cuda-j.json" ) \
  > "$OUT/repro-cuda-j.log" 2>&1; echo "repro -j rc=$?"
( time timeout 170 python3 -m repro --device cuda -j 1 --json "$OUT/repro-cuda-j1.json" ) \
  > "$OUT/repro-cuda-j1.log" 2>&1; echo "repro -j 1 rc=$?"
( time timeout 200 python3 -m pytest tests -m gpu -n 8 -p no:cacheprovider -q -rs --durations=25 \
  -p repro.harness.skip_audit --skip-audit=gpu ) > "$OUT/pytest-gpu-n8.log" 2>&1; echo "gpu suite rc=$?"
tail -n 4 "$OUT"/*.log
